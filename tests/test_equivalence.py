"""Cached serving equals a full forward with the equivalent attention mask, on tiny models of several architectures."""

from __future__ import annotations

import pytest
import torch
from reference import independent_sequence, masked_forward, reference_greedy, reference_last_logits

from pc_rag.assemble import move
from pc_rag.encode import encode_spans
from pc_rag.engine import PromptCache
from pc_rag.model import LoadedModel
from pc_rag.pml.nodes import Import, Module, Param, Prompt, Role, Scaffold, Schema, Text, Union

DOC = "The Eiffel Tower was completed in 1889 and is 330 metres tall. It stands in Paris."
OTHER = "Mount Fuji is the highest mountain in Japan, at 3,776 metres, on Honshu island."
QUESTION = " Question: how tall is the tower? Answer:"


def assert_close(actual: torch.Tensor, expected: torch.Tensor, rel: float = 1e-4) -> None:
    err = (actual - expected).abs().max() / expected.abs().max()
    assert err < rel, f"relative error {err:.2e} >= {rel:.0e}"


def test_single_module_equals_plain_forward(tiny_lm: LoadedModel) -> None:
    pc = PromptCache(tiny_lm)
    pc.add_schema(Schema("s", (Module("doc", (Text(DOC),)),)))
    prompt = Prompt("s", (Import("doc"), Text(QUESTION)))
    cached = pc.generate(prompt, max_new_tokens=1).first_logits
    ids = pc.full_prompt_ids(prompt)
    with torch.no_grad():
        plain = tiny_lm.model(input_ids=torch.tensor([ids])).logits[0, -1]
    assert_close(cached, plain)


RICH = Schema(
    "rich",
    (
        Text("You answer questions about places."),
        Module("plan", (Text("Plan a visit of "), Param("days", 4), Text(" days to the sights."))),
        Union((Module("paris", (Text(DOC),)), Module("fuji", (Text(OTHER),)))),
        Module("outer", (Text("Outer text "), Module("inner", (Text("inner text"),)), Text(" outer tail."))),
        Scaffold("pair", (Module("a", (Text("Alpha knows beta."),)), Module("b", (Text("Beta knows alpha."),)))),
        Text(" Be brief."),
    ),
)

PROMPTS = {
    "modules+param": Prompt("rich", (Import("plan", (("days", "three"),)), Import("paris"), Text(QUESTION))),
    "other-union-member": Prompt("rich", (Import("fuji"), Text(QUESTION))),
    "nested": Prompt("rich", (Import("outer", children=(Import("inner"),)), Text(QUESTION))),
    "scaffold-joint": Prompt("rich", (Import("a"), Import("b"), Text(QUESTION))),
    "scaffold-partial": Prompt("rich", (Import("a"), Import("paris"), Text(QUESTION))),
}


@pytest.mark.parametrize("case", sorted(PROMPTS))
def test_modules_equal_masked_full_forward(tiny_lm: LoadedModel, case: str) -> None:
    pc = PromptCache(tiny_lm)
    pc.add_schema(RICH)
    prompt = PROMPTS[case]
    cached = pc.generate(prompt, max_new_tokens=1).first_logits
    assert_close(cached, reference_last_logits(pc, prompt))


@pytest.mark.parametrize("case", sorted(PROMPTS))
def test_serving_equals_an_independently_derived_masked_forward(tiny_lm: LoadedModel, case: str) -> None:
    """The reference above takes ids and positions from the engine's plan; this one derives them from the schema
    with a second implementation of the PML rules, so a layout bug cannot hide in both."""
    pc = PromptCache(tiny_lm)
    pc.add_schema(RICH)
    prompt = PROMPTS[case]

    def tokenize(text: str) -> list[int]:
        return tiny_lm.tokenizer(text, add_special_tokens=False)["input_ids"]

    with_special, plain = tiny_lm.tokenizer("x")["input_ids"], tokenize("x")
    bos = with_special[: len(with_special) - len(plain)]
    cached, prefix, new_ids, new_positions = independent_sequence(RICH, prompt, tokenize, bos)
    plan = pc.plan(prompt)
    assert (list(plan.new_ids), list(plan.new_positions)) == (new_ids, new_positions)
    served = pc.generate(prompt, max_new_tokens=1).first_logits
    assert_close(served, masked_forward(tiny_lm.model, cached, prefix, new_ids, new_positions))


@pytest.mark.parametrize("case", ["modules+param", "scaffold-joint", "argument-only"])
def test_greedy_decoding_equals_masked_full_forwards(tiny_lm: LoadedModel, case: str) -> None:
    """Every decoded token, not only the first: each step equals a masked full forward over all before it."""
    pc = PromptCache(tiny_lm)
    pc.add_schema(RICH)
    prompt = ARGUMENT_ONLY if case == "argument-only" else PROMPTS[case]
    result = pc.generate(prompt, max_new_tokens=6, keep_logits=6)
    tokens, logits = reference_greedy(pc, prompt, len(result.token_ids))
    assert result.token_ids == tokens and len(tokens) > 1
    for actual, expected in zip(result.step_logits, logits, strict=True):
        assert_close(actual, expected)


ARGUMENT_ONLY = Prompt("rich", (Import("plan", (("days", "three"),)), Import("paris")))


def test_an_argument_only_prompt_decodes_after_the_whole_schema(tiny_lm: LoadedModel) -> None:
    """Hand-derived: the argument sits inside ``plan``; the answer starts past the schema's closing anonymous
    text, the last span the prompt includes (anonymous text always is)."""
    pc = PromptCache(tiny_lm)
    layout = pc.add_schema(RICH).layout
    plan = pc.plan(ARGUMENT_ONLY)
    days_start, _ = layout.spans["plan"].params["days"]
    assert plan.new_positions == tuple(range(days_start, days_start + len(pc.tokenize("three"))))
    closing = layout.spans["#text1"]
    assert plan.spans[-1] == "#text1" and closing.end == layout.length
    assert plan.next_position == closing.positions[-1] + 1 == layout.length
    assert plan.next_position > max(plan.new_positions) + 1  # the old rule would have decoded inside `plan`


def test_mask_matters(tiny_lm: LoadedModel) -> None:
    """Guard against a vacuous reference: splicing differs from an unmasked forward when modules are separate."""
    pc = PromptCache(tiny_lm)
    pc.add_schema(RICH)
    prompt = PROMPTS["modules+param"]
    cached = pc.generate(prompt, max_new_tokens=1).first_logits
    with torch.no_grad():
        plain = tiny_lm.model(input_ids=torch.tensor([pc.full_prompt_ids(prompt)])).logits[0, -1]
    err = (cached - plain).abs().max() / plain.abs().max()
    assert err > 1e-3


@pytest.mark.parametrize("delta", [7, 300, -5])
def test_rerotated_module_equals_direct_encoding(tiny_lm: LoadedModel, delta: int) -> None:
    ids = tiny_lm.tokenizer(DOC, add_special_tokens=False)["input_ids"]
    start = 40
    at_start, at_moved = encode_spans(
        tiny_lm.model,
        [(ids, range(start, start + len(ids))), (ids, range(start + delta, start + delta + len(ids)))],
    )
    moved = move(at_start, tiny_lm.rope, delta)
    assert torch.equal(moved.positions, at_moved.positions)
    assert_close(moved.keys, at_moved.keys, rel=1e-5)
    assert_close(moved.values, at_moved.values, rel=1e-5)


@pytest.mark.parametrize("rotary_dim", [8, 12])  # full and partial rotary (Phi-3 style) of 8- or 12-wide heads
@pytest.mark.parametrize("delta", [5, torch.tensor([1, -3, 700])])
def test_rotation_into_a_buffer_equals_rotation(rotary_dim: int, delta: int | torch.Tensor) -> None:
    from pc_rag.rope import rotate_keys, rotate_keys_into

    keys, inv_freq = torch.randn(2, 3, 3, 12), 1.0 / 10000 ** (torch.arange(rotary_dim // 2) / (rotary_dim // 2))
    out = torch.full((2, 3, 5, 12), float("nan"))[:, :, 1:4]  # a strided view, as a cache buffer's slice is
    rotate_keys_into(out, keys, delta, inv_freq)
    assert torch.allclose(out, rotate_keys(keys, delta, inv_freq), atol=1e-6)


def test_a_host_delta_rotates_as_a_device_one_with_tables_kept_per_device(tiny_lm: LoadedModel) -> None:
    """An int delta multiplies the device table (no host-to-device copy) and gives the bits of the same delta
    as a tensor; the float64 table is copied to a device once."""
    rope = tiny_lm.rope
    keys = torch.randn(rope.num_layers, 2, 7, rope.head_dim)
    by_int, by_tensor = torch.empty_like(keys), torch.empty_like(keys)
    rope.rotate_into(by_int, keys, 9)
    rope.rotate_into(by_tensor, keys, torch.tensor([9]))
    assert torch.equal(by_int, by_tensor)
    assert rope.table(0, keys.device) is rope.table(0, keys.device)
    assert rope.table(0, keys.device).dtype == torch.float64


def test_positions_follow_schema(tokenizer) -> None:
    from pc_rag.layout import layout_schema

    def tokenize(text: str) -> list[int]:
        return tokenizer(text, add_special_tokens=False)["input_ids"]

    layout = layout_schema(RICH, tokenize, wrappers=lambda: pytest.fail("no roles here"))
    spans = layout.spans
    n = {name: len(s.token_ids) for name, s in spans.items()}
    head = n["#text0"]
    plan_len = n["plan"] + 4
    assert spans["plan"].start == head and spans["plan"].end == head + plan_len
    assert spans["plan"].params["days"] == (head + len(tokenize("Plan a visit of ")), 4)
    assert spans["paris"].start == spans["fuji"].start == head + plan_len  # union members share a start
    union_end = head + plan_len + max(n["paris"], n["fuji"])  # the union is as long as its longest member
    assert spans["outer"].start == union_end
    assert spans["inner"].start == union_end + len(tokenize("Outer text "))
    assert spans["a"].start == spans["outer"].end and spans["b"].start == spans["a"].end
    assert spans["#text1"].start == spans["b"].end and layout.length == spans["#text1"].end
    # a param's reserved slots are skipped by the module's own tokens
    days_start, days_len = spans["plan"].params["days"]
    assert days_start + days_len == spans["plan"].positions[len(tokenize("Plan a visit of "))]


def test_arguments_and_text_land_where_the_schema_says(tiny_lm: LoadedModel) -> None:
    pc = PromptCache(tiny_lm)
    layout = pc.add_schema(RICH).layout
    plan = pc.plan(PROMPTS["modules+param"])
    days_start, _ = layout.spans["plan"].params["days"]
    arg_len = len(pc.tokenize("three"))
    assert plan.new_positions[:arg_len] == tuple(range(days_start, days_start + arg_len))
    # text after the last import follows every included span, the trailing anonymous text included
    question = plan.new_positions[arg_len:]
    assert question == tuple(range(layout.spans["#text1"].end, layout.spans["#text1"].end + len(question)))
    assert plan.next_position == question[-1] + 1


def test_roles_render_through_chat_template(tiny_lm: LoadedModel) -> None:
    pc = PromptCache(tiny_lm)
    schema = Schema("chat", (Role("system", (Text("Be terse."),)), Module("doc", (Text(DOC),))))
    pc.add_schema(schema)
    prompt = Prompt("chat", (Import("doc"), Role("user", (Text("How tall?"),))))
    rendered = tiny_lm.tokenizer.decode(pc.full_prompt_ids(prompt))
    expected = tiny_lm.tokenizer.apply_chat_template(
        [{"role": "system", "content": "Be terse."}, {"role": "user", "content": "How tall?"}],
        tokenize=False,
        add_generation_prompt=True,
    )
    assert rendered == expected.replace("<|im_end|>\n<|im_start|>user", f"<|im_end|>\n{DOC}<|im_start|>user")
    cached = pc.generate(prompt, max_new_tokens=1).first_logits
    assert_close(cached, reference_last_logits(pc, prompt))
