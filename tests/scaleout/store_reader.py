"""Another process that loads a store whose KV lives in Redis and answers one question, counting encodes.

Usage: ``store_reader.py STORE REDIS_URL QUESTION``; prints ``encoded N`` (chunks this process encoded) and
the answer's token ids.
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent.parent))

from conftest import tiny_model, tiny_tokenizer
from test_document_store import embedder

from pc_rag.rag import RagEngine, RagPrompt
from pc_rag.server.prompt_server import PromptServer
from pc_rag.store.document_store import DocumentStore

encoded: list[int] = []
_encode = RagEngine.encode_token_ids


def _counted(self, token_ids, *args, **kwargs):
    encoded.append(len(token_ids))
    return _encode(self, token_ids, *args, **kwargs)


RagEngine.encode_token_ids = _counted

if __name__ == "__main__":
    directory, url, question = sys.argv[1:4]
    engine = RagEngine(tiny_model("llama", tiny_tokenizer()), RagPrompt())
    with DocumentStore.load(directory, engine, embedder=embedder(), modules=url) as store:
        answer = PromptServer(store=store).answer(question, k=2, max_new_tokens=6)
    print(f"encoded {sum(encoded)}")
    print(repr(answer.result.token_ids))
