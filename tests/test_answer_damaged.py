"""An answer survives a damaged chunk: it is answered from the other retrieved chunks, the damaged one is listed
as skipped in the reply, and one warning names ``pc-rag store repair``."""

from __future__ import annotations

import logging

import pytest
from test_store_repair import build, eng, flip_bytes, load  # noqa: F401 (the eng fixture)

from pc_rag.errors import StoreCorruptedError
from pc_rag.server.prompt_server import PromptServer


def test_an_answer_skips_a_damaged_chunk_and_warns_once(tmp_path, eng, caplog) -> None:  # noqa: F811
    built = build(tmp_path / "s", eng)
    store = load(tmp_path / "s", eng)
    question = built.manifest.chunks[built.manifest.docs["doc3"].chunk_ids[0]].text[:60]
    ranked = store.search(question, 4)
    victim = ranked[1].chunk_id
    flip_bytes(tmp_path / "s", f"{victim}.k")
    store = load(tmp_path / "s", eng)
    server = PromptServer(store=store)
    with caplog.at_level(logging.WARNING):
        for full in (False, True, False):
            answer = (server.answer_full if full else server.answer)(question, k=4, max_new_tokens=2)
            assert [h.chunk_id for h in answer.skipped] == [victim]
            assert [h.chunk_id for h in answer.sources] == [h.chunk_id for h in ranked if h.chunk_id != victim]
            assert answer.result.token_ids
    warnings = [r.getMessage() for r in caplog.records if "pc-rag store repair" in r.getMessage()]
    assert len(warnings) == 1 and f"chunk {victim}" in warnings[0] and "other 3 retrieved chunks" in warnings[0]


def test_an_answer_whose_every_chunk_is_damaged_fails_naming_repair(tmp_path, eng) -> None:  # noqa: F811
    build(tmp_path / "s", eng)
    store = load(tmp_path / "s", eng)
    (hit,) = store.search("anything", 1)
    flip_bytes(tmp_path / "s", f"{hit.chunk_id}.k")
    with pytest.raises(StoreCorruptedError, match="pc-rag store repair"):
        PromptServer(store=load(tmp_path / "s", eng)).answer("anything", k=1, max_new_tokens=1)
