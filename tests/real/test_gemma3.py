"""Gemma 3 270M (real weights, sliding-window layers): cached serving equals the masked full forward."""

from __future__ import annotations

import pytest
from reference import reference_last_logits

from pc_rag.engine import PromptCache
from pc_rag.model import bundled_model_problem, load_model
from pc_rag.pml.nodes import Import, Module, Prompt, Schema, Text

pytestmark = [
    pytest.mark.real_model,
    pytest.mark.skipif(
        bundled_model_problem("gemma3-270m") is not None,
        reason=f"Gemma 3 270M (a second real architecture, optional) {bundled_model_problem('gemma3-270m')}",
    ),
]

FILLER = " ".join(f"Fact {i}: the number {i} follows {i - 1}." for i in range(1, 60))  # > 512 tokens in all


def test_gemma3_modules_equal_masked_full_forward() -> None:
    pc = PromptCache(load_model("gemma3-270m"))
    pc.add_schema(
        Schema(
            "g", (Text("Notes.\n"), Module("facts", (Text(FILLER),)), Module("city", (Text("Paris is in France."),)))
        )
    )
    prompt = Prompt("g", (Import("facts"), Import("city"), Text("\nQuestion: where is Paris? Answer:")))
    assert len(pc.full_prompt_ids(prompt)) > 512  # beyond the sliding window
    cached = pc.generate(prompt, max_new_tokens=1).first_logits
    expected = reference_last_logits(pc, prompt)
    assert float((cached - expected).abs().max() / expected.abs().max()) < 1e-4


def test_gemma3_serves_rag_with_its_shipped_adapter_as_the_default_mode() -> None:
    from pc_rag.rag import RagEngine, RagPrompt
    from pc_rag.rag.tuned import PACKAGED, adapter_file

    lm = load_model("gemma3-270m")
    assert (PACKAGED / adapter_file(lm.fingerprint())).is_file()  # shipped, so `fast` is not a SmolLM2-only mode
    engine = RagEngine(lm, RagPrompt.longbench())  # a base model: the plain-text prompt
    assert engine.default_mode == "fast"
    chunks = engine.encode(["Passage 1:\nParis\nThe Eiffel Tower is in Paris, France.\n\n"])
    fast = engine.answer(chunks, "In which city is the Eiffel Tower?", max_new_tokens=8)
    full = engine.answer_full(chunks, "In which city is the Eiffel Tower?", max_new_tokens=8)
    assert "\n" not in fast.text and "\n" not in full.text  # replies end at a line break (the 270M base model's
    assert fast.stats.new_tokens >= 1 and full.stats.new_tokens >= 1  # answers are weak: no quality is asserted)
