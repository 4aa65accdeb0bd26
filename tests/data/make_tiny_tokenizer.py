"""Build the tiny tokenizer the unit tests use: byte-level BPE, 2,048 tokens, ChatML like SmolLM2's.

    python tests/data/make_tiny_tokenizer.py   # writes tests/data/tiny-tokenizer/

Trained on the bundled HotpotQA sample, so test texts tokenize into a few tokens per word; the special
tokens and chat template are SmolLM2's, so the engine's chat handling is exercised as with the real model.
Byte-level: any text tokenizes. Deterministic: rerunning writes the same files.
"""

from __future__ import annotations

import json
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

OUT = Path(__file__).parent / "tiny-tokenizer"
SAMPLE = Path(__file__).parents[2] / "pc_rag" / "data" / "hotpotqa_sample.jsonl"
SPECIAL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CHAT_TEMPLATE = (
    "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\\n' }}"
    "{% endif %}{{'<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n'}}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)


def corpus() -> list[str]:
    texts = []
    for line in SAMPLE.read_text(encoding="utf-8").splitlines():
        row = json.loads(line)
        texts.append(row["question"])
        texts += [f"{p['title']}\n{p['text']}" for p in row["passages"]]
    return texts


def main() -> None:
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=2048,
        special_tokens=SPECIAL,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(corpus(), trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tokenizer, bos_token="<|im_start|>", eos_token="<|im_end|>", pad_token="<|im_end|>",
        unk_token="<|endoftext|>",
    )  # fmt: skip
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(OUT)


if __name__ == "__main__":
    main()
