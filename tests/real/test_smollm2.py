"""The same reference equivalence on the real SmolLM2-135M, plus greedy generation against full prefill."""

from __future__ import annotations

import pytest
import torch
from reference import reference_last_logits

from pc_rag.engine import PromptCache
from pc_rag.model import LoadedModel
from pc_rag.pml.nodes import Import, Module, Param, Prompt, Role, Schema, Text, Union

pytestmark = pytest.mark.real_model

SYSTEM = "You are a concise assistant. Answer from the documents."
DOC = (
    "The Eiffel Tower is a wrought-iron lattice tower on the Champ de Mars in Paris, France. "
    "It is named after the engineer Gustave Eiffel, whose company designed and built the tower "
    "from 1887 to 1889. It is 330 metres tall."
)
FUJI = "Mount Fuji is the highest mountain in Japan at 3,776 metres. It is an active volcano on Honshu."


@pytest.fixture(scope="module")
def pc(smollm2: LoadedModel) -> PromptCache:
    cache = PromptCache(smollm2)
    cache.add_schema(
        Schema(
            "docs",
            (
                Role("system", (Text(SYSTEM),)),
                Module("note", (Text("Reply within "), Param("words", 4), Text(" words."))),
                Union((Module("eiffel", (Text(DOC),)), Module("fuji", (Text(FUJI),)))),
            ),
        )
    )
    cache.add_schema(Schema("single", (Role("system", (Text(SYSTEM),)), Module("eiffel", (Text(DOC),)))))
    return cache


def relative_error(actual: torch.Tensor, expected: torch.Tensor) -> float:
    return float((actual - expected).abs().max() / expected.abs().max())


def test_single_module_equals_plain_forward(pc: PromptCache) -> None:
    prompt = Prompt("single", (Import("eiffel"), Role("user", (Text("Who designed the tower?"),))))
    cached = pc.generate(prompt, max_new_tokens=1).first_logits
    with torch.no_grad():
        plain = pc.lm.model(input_ids=torch.tensor([pc.full_prompt_ids(prompt)])).logits[0, -1]
    assert relative_error(cached, plain) < 1e-4


@pytest.mark.parametrize("member", ["eiffel", "fuji"])
def test_modules_equal_masked_full_forward(pc: PromptCache, member: str) -> None:
    prompt = Prompt(
        "docs",
        (Import("note", (("words", "ten"),)), Import(member), Role("user", (Text("What is it and how tall?"),))),
    )
    cached = pc.generate(prompt, max_new_tokens=1).first_logits
    assert relative_error(cached, reference_last_logits(pc, prompt)) < 1e-4


def test_greedy_generation_matches_full_prefill(pc: PromptCache) -> None:
    prompt = Prompt("single", (Import("eiffel"), Role("user", (Text("Who designed the tower?"),))))
    cached = pc.generate(prompt, max_new_tokens=24)
    full = pc.generate_full(prompt, max_new_tokens=24)
    assert cached.token_ids == full.token_ids and cached.text == full.text
    assert cached.stats.cached_tokens > 0 and cached.stats.computed_tokens < full.stats.computed_tokens
    assert "Eiffel" in cached.text


def test_stream_matches_generate(pc: PromptCache) -> None:
    prompt = Prompt("docs", (Import("eiffel"), Role("user", (Text("Who built it?"),))))
    stream = pc.stream(prompt, max_new_tokens=16)
    pieces = list(stream)
    assert stream.result is not None and "".join(pieces) == stream.result.text
    assert stream.result.text == pc.generate(prompt, max_new_tokens=16).text
