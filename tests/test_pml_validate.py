"""Prompts checked against their schema, argument lengths, and the module index the layout reuses."""

from __future__ import annotations

import pytest

from pc_rag.errors import (
    ArgumentTooLongError,
    DuplicateNameError,
    PMLError,
    UnionConflictError,
    UnknownModuleError,
    UnknownParamError,
    UnknownSchemaError,
)
from pc_rag.pml import (
    Import,
    ModuleInfo,
    check_argument_lengths,
    iter_imports,
    module_index,
    parse_prompt,
    parse_schema,
    validate_prompt,
)

SCHEMA = parse_schema(
    """<schema name="travel">
  <system>You are a travel agent. <module name="persona">Persona <param name="tone" len="2"/></module></system>
  <module name="plan">Plan a trip of <param name="duration" len="4"/> for <param name="who" len="3"/>.
    <module name="budget">Budget: <param name="amount" len="2"/></module>
    <union><module name="cheap">cheap</module><module name="luxury">luxury</module></union>
  </module>
  <union>
    <module name="tokyo">Tokyo</module>
    <module name="paris">Paris</module>
  </union>
  <scaffold name="pair"><module name="a">A</module><module name="b">B</module></scaffold>
</schema>"""
)


def prompt(body: str, schema: str = "travel") -> str:
    return f'<prompt schema="{schema}">{body}</prompt>'


def test_module_index() -> None:
    index = module_index(SCHEMA)
    assert list(index) == ["persona", "plan", "budget", "cheap", "luxury", "tokyo", "paris", "a", "b"]
    assert index["persona"] == ModuleInfo(index["persona"].module, None, None, None, {"tone": 2})
    assert index["plan"].params == {"duration": 4, "who": 3}
    assert list(index["plan"].params) == ["duration", "who"]
    assert (index["budget"].parent, index["budget"].union, index["budget"].params) == ("plan", None, {"amount": 2})
    assert (index["cheap"].parent, index["cheap"].union) == ("plan", 0)
    assert (index["tokyo"].parent, index["tokyo"].union, index["paris"].union) == (None, 1, 1)
    assert (index["a"].scaffold, index["b"].scaffold, index["a"].union) == ("pair", "pair", None)
    assert index["tokyo"].module.name == "tokyo"


@pytest.mark.parametrize(
    "body",
    [
        "",
        '<plan duration="3 days"/><tokyo/><user>Highlight the food markets.</user>',
        "<plan/>",  # missing arguments leave params empty
        '<system><persona tone="dry"/></system><plan who="me"><budget amount="9"/><luxury/></plan><paris/>',
        "<a/><b/>",
        "Uncached text <tokyo/>",
    ],
)
def test_valid_prompts(body: str) -> None:
    validate_prompt(parse_prompt(prompt(body)), SCHEMA)


ERRORS = [
    ("unknown-schema", prompt("<plan/>", schema="trip"), UnknownSchemaError, "trip"),
    ("unknown-module", prompt("<rome/>"), UnknownModuleError, "rome"),
    ("unknown-module-in-role", prompt("<user><rome/></user>"), UnknownModuleError, "rome"),
    ("nested-not-a-child", prompt("<plan><tokyo/></plan>"), UnknownModuleError, "tokyo"),
    ("nested-at-top-level", prompt("<budget/>"), UnknownModuleError, "budget"),
    ("nested-too-deep", prompt("<plan><budget><cheap/></budget></plan>"), UnknownModuleError, "cheap"),
    ("unknown-param", prompt('<plan days="3"/>'), UnknownParamError, "days"),
    ("param-of-nested-module", prompt('<plan amount="3"/>'), UnknownParamError, "amount"),
    ("union-conflict", prompt("<tokyo/><paris/>"), UnionConflictError, "paris"),
    ("nested-union-conflict", prompt("<plan><cheap/><luxury/></plan>"), UnionConflictError, "luxury"),
    ("duplicate-import", prompt("<tokyo/><user><tokyo/></user>"), DuplicateNameError, "tokyo"),
]


@pytest.mark.parametrize(("source", "error", "name"), [c[1:] for c in ERRORS], ids=[c[0] for c in ERRORS])
def test_validation_errors(source: str, error: type[PMLError], name: str) -> None:
    with pytest.raises(error) as caught:
        validate_prompt(parse_prompt(source), SCHEMA)
    assert type(caught.value) is error
    assert caught.value.name == name


def words(text: str) -> int:
    return len(text.split())


def test_argument_lengths() -> None:
    fits = parse_prompt(prompt('<plan duration="one two three four" who="a b c"><budget amount="x y"/></plan>'))
    check_argument_lengths(fits, SCHEMA, words)
    too_long = parse_prompt(prompt('<plan duration="3 days"><budget amount="a b c"/></plan>'))
    with pytest.raises(ArgumentTooLongError) as caught:
        check_argument_lengths(too_long, SCHEMA, words)
    assert caught.value.name == "amount"
    assert "3 tokens" in str(caught.value)


def test_argument_lengths_validate_first() -> None:
    with pytest.raises(UnknownParamError):
        check_argument_lengths(parse_prompt(prompt('<plan days="1"/>')), SCHEMA, words)


def test_iter_imports_reports_parents() -> None:
    parsed = parse_prompt(prompt("<system><persona/></system><plan><budget/></plan>"))
    assert [(node.name, parent) for node, parent in iter_imports(parsed)] == [
        ("persona", None),
        ("plan", None),
        ("budget", "plan"),
    ]
    assert all(isinstance(node, Import) for node, _ in iter_imports(parsed))
