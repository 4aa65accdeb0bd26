"""Property-based tests of the PML parser and builder: whatever the input, only ``PMLError`` escapes.

Random element trees over PML's tags (and foreign ones) with random names, attributes and text; random
strings and byte soup; deep nesting; huge attributes; entity and DTD tricks. A document that parses
serializes back (``to_xml``) to one that parses to the same nodes.
"""

from __future__ import annotations

from collections.abc import Callable
from xml.sax.saxutils import quoteattr

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pc_rag.errors import PMLError, PMLSyntaxError
from pc_rag.pml import (
    MAX_DEPTH,
    MAX_SOURCE_BYTES,
    Prompt,
    Schema,
    SchemaBuilder,
    module,
    param,
    parse_prompt,
    parse_schema,
    to_xml,
)
from pc_rag.pml.builder import union

FUZZ = settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
TAGS = ["schema", "prompt", "module", "union", "param", "system", "user", "assistant", "scaffold", "x", "b"]
ATTRS = ["name", "len", "schema", "scaffold", "v", "x"]
names = st.one_of(
    st.sampled_from(["a", "doc", "s", "city", "x1", "user", "module", "xml", "_n", "n-2"]),
    st.text(min_size=0, max_size=12),
)
values = st.one_of(names, st.integers(-5, 10**7).map(str), st.text(max_size=40))
texts = st.text(max_size=30)


@st.composite
def elements(draw: st.DrawFn, depth: int = 0) -> str:
    tag = draw(st.sampled_from(TAGS))
    attrs = draw(st.dictionaries(st.sampled_from(ATTRS), values, max_size=3))
    rendered = "".join(f" {k}={quoteattr(v)}" for k, v in attrs.items())
    if depth >= 4 or draw(st.booleans()):
        return f"<{tag}{rendered}/>"
    body = draw(st.lists(st.one_of(texts.map(_escape), elements(depth + 1)), max_size=4))
    return f"<{tag}{rendered}>{''.join(body)}</{tag}>"


def _escape(text: str) -> str:
    return text.replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;")


def parses_or_pml_error(parse: Callable[[str], Schema | Prompt], source: str) -> Schema | Prompt | None:
    try:
        return parse(source)
    except PMLError:
        return None


@FUZZ
@given(elements())
def test_random_element_trees(source: str) -> None:
    for parse in (parse_schema, parse_prompt):
        node = parses_or_pml_error(parse, source)
        if node is not None:
            assert parse(to_xml(node)) == node  # what parses round-trips


@FUZZ
@given(st.text(max_size=300))
def test_random_strings(source: str) -> None:
    parses_or_pml_error(parse_schema, source)
    parses_or_pml_error(parse_prompt, source)


@FUZZ
@given(st.binary(max_size=300))
def test_random_bytes_as_text(data: bytes) -> None:
    source = data.decode("latin-1")
    parses_or_pml_error(parse_schema, "<schema name='s'>" + source + "</schema>")
    parses_or_pml_error(parse_prompt, source)


@FUZZ
@given(st.text(min_size=1, max_size=20), st.text(max_size=20), st.integers(-(2**70), 2**70))
def test_builder_with_random_names_and_lengths(name: str, body: str, length: int) -> None:
    try:
        schema = SchemaBuilder(name).module(name, body, param(name, length)).add(union(module(name + "2"))).build()
    except PMLError:
        return
    assert parse_schema(to_xml(schema)) == schema


@pytest.mark.parametrize("depth", [MAX_DEPTH + 1, 10_000])
def test_deep_nesting_is_a_clear_error(depth: int) -> None:
    source = "<schema name='s'>" + "<module name='m'>" * depth + "</module>" * depth + "</schema>"
    with pytest.raises(PMLError, match=f"deeper than {MAX_DEPTH}|malformed XML"):
        parse_schema(source)


def test_a_huge_attribute_is_a_clear_error() -> None:
    source = f"<schema name='{'a' * (MAX_SOURCE_BYTES + 1)}'/>"
    with pytest.raises(PMLSyntaxError, match="more than the limit"):
        parse_schema(source)


@FUZZ
@given(st.sampled_from(["lol", "x", "e"]), st.text(alphabet="abc&;%", max_size=20))
def test_entities_are_never_expanded(entity: str, value: str) -> None:
    for declaration in (f'<!ENTITY {entity} "{value}">', f'<!ENTITY {entity} SYSTEM "file:///etc/passwd">'):
        source = f"<!DOCTYPE schema [{declaration}]><schema name='s'><module name='m'>&{entity};</module></schema>"
        with pytest.raises(PMLSyntaxError):
            parse_schema(source)
