"""The Python builders produce the parser's trees, share its rules, and round-trip through to_xml."""

from __future__ import annotations

import pytest
from pml_examples import PROMPT_XML, TRAVEL_XML

from pc_rag.errors import DuplicateNameError, InvalidNameError, PMLError, PMLStructureError
from pc_rag.pml import (
    Import,
    Module,
    Param,
    Prompt,
    PromptBuilder,
    Role,
    Schema,
    SchemaBuilder,
    Text,
    Union,
    assistant,
    module,
    param,
    parse_prompt,
    parse_schema,
    scaffold,
    system,
    to_xml,
    union,
    use,
    user,
)


def travel() -> Schema:
    return (
        SchemaBuilder("travel")
        .system("You are a helpful travel agent.")
        .module("plan", "Plan a trip of ", param("duration", 4), " for the user.")
        .union(
            module("tokyo", "Tokyo is the capital of Japan ..."), module("paris", "Paris is the capital of France ...")
        )
        .scaffold("pair", module("a", "A text"), module("b", "B text"))
        .build()
    )


def test_schema_builder_matches_parser_and_round_trips() -> None:
    schema = travel()
    assert schema == parse_schema(TRAVEL_XML)
    assert parse_schema(to_xml(schema)) == schema


def test_prompt_builder_matches_parser_and_round_trips() -> None:
    prompt = (
        PromptBuilder("travel").use("plan", duration="3 days").use("tokyo").user("Highlight the food markets.").build()
    )
    assert prompt == parse_prompt(PROMPT_XML)
    assert parse_prompt(to_xml(prompt)) == prompt


def test_rich_schema_round_trips() -> None:
    schema = (
        SchemaBuilder("rich")
        .text("Intro & <rules>\r\n", "  ")
        .system("Be brief. ", module("persona", "You are ", param("name", 8), "."))
        .module(
            "doc",
            "Title: ",
            param("title", 16),
            " ",
            param("year", 2),
            "\n",
            module("body", "]]> \"quoted\" 'single' \t tab"),
            union(module("en", "English"), module("fr", "Français ✓")),
        )
        .assistant("Sure.")
        .user(union(module("q1", "Q1"), module("q2", "Q2")))
        .build()
    )
    assert schema.children[0] == Text("Intro & <rules>\r\n  ")
    assert parse_schema(to_xml(schema)) == schema


def test_rich_prompt_round_trips() -> None:
    prompt = (
        PromptBuilder("rich")
        .text("uncached\r\n")
        .system(use("persona", name='A "quoted"\n\tname & <co>'))
        .use("doc", use("body"), use("fr"), title="t", year="24")
        .assistant("ok")
        .build()
    )
    assert prompt.children[2] == Import("doc", (("title", "t"), ("year", "24")), (Import("body"), Import("fr")))
    assert parse_prompt(to_xml(prompt)) == prompt


def test_strings_follow_the_whitespace_rule() -> None:
    built = module("m", "a", "b", " ", "\n", param("p", 1), " ", param("q", 1), "  ", module("n"), "")
    assert built == Module("m", (Text("ab \n"), Param("p", 1), Text(" "), Param("q", 1), Module("n", ())))
    assert SchemaBuilder("s").text("  ").module("m").text("\n").build() == Schema("s", (Module("m", ()),))
    assert user("hi ", use("x"), " ") == Role("user", (Text("hi "), Import("x")))


def test_use_takes_an_argument_called_name() -> None:
    assert use("person", name="Ada") == Import("person", (("name", "Ada"),))
    assert PromptBuilder("s").use("person", name="Ada").build() == Prompt("s", (Import("person", (("name", "Ada"),)),))


def _schema(*children: object) -> SchemaBuilder:
    return SchemaBuilder("s").add(*children)  # type: ignore[arg-type]


SCHEMA_ERRORS = [
    ("duplicate-module", _schema(module("m"), module("m")), DuplicateNameError, "m"),
    ("duplicate-nested", _schema(module("m", union(module("n"))), module("n")), DuplicateNameError, "n"),
    ("duplicate-param", _schema(module("m", param("p", 1), param("p", 2))), DuplicateNameError, "p"),
    ("reserved-name", _schema(module("scaffold")), InvalidNameError, "scaffold"),
    ("invalid-name", _schema(module("has space")), InvalidNameError, "has space"),
    ("invalid-schema-name", SchemaBuilder("1s"), InvalidNameError, "1s"),
    ("param-outside-module", _schema(param("p", 1)), PMLStructureError, "p"),
    ("param-in-role", _schema(system(param("p", 1))), PMLStructureError, "p"),
    ("param-zero", _schema(module("m", param("p", 0))), PMLStructureError, "p"),
    ("param-too-long", _schema(module("m", param("p", 5000))), PMLStructureError, "p"),
    ("param-bool", _schema(module("m", param("p", True))), PMLStructureError, "p"),
    ("union-non-module", _schema(union(module("a"), Text("x"))), PMLStructureError, None),  # type: ignore[arg-type]
    ("empty-union", _schema(union()), PMLStructureError, None),
    ("scaffold-one", _schema(scaffold("p", module("a"))), PMLStructureError, None),
    ("scaffold-in-role", _schema(user(scaffold("p", module("a"), module("b")))), PMLStructureError, "p"),
    ("nested-role", _schema(system(user("x"))), PMLStructureError, None),
    ("role-in-module", _schema(module("m", assistant("x"))), PMLStructureError, None),
    ("import-in-schema", _schema(use("m")), PMLStructureError, "m"),
    ("illegal-char", _schema("bell \x07"), PMLStructureError, None),
    ("bad-role", _schema(Role("robot", ())), PMLStructureError, "robot"),  # type: ignore[arg-type]
]


@pytest.mark.parametrize(
    ("builder", "error", "name"), [c[1:] for c in SCHEMA_ERRORS], ids=[c[0] for c in SCHEMA_ERRORS]
)
def test_schema_builder_errors(builder: SchemaBuilder, error: type[PMLError], name: str | None) -> None:
    with pytest.raises(error) as caught:
        builder.build()
    assert type(caught.value) is error
    assert caught.value.line is None
    if name is not None:
        assert caught.value.name == name


PROMPT_ERRORS = [
    ("text-in-import", PromptBuilder("s").add(use("plan", "3 days")), PMLStructureError, None),  # type: ignore[arg-type]
    ("role-in-import", PromptBuilder("s").add(Import("a", (), (user("x"),))), PMLStructureError, None),  # type: ignore[arg-type]
    ("nested-role", PromptBuilder("s").system(user("x")), PMLStructureError, None),
    ("reserved-import", PromptBuilder("s").use("param"), InvalidNameError, "param"),
    ("duplicate-arg", PromptBuilder("s").add(Import("a", (("x", "1"), ("x", "2")))), DuplicateNameError, "x"),
    ("non-str-arg", PromptBuilder("s").add(Import("a", (("x", 1),))), PMLStructureError, None),  # type: ignore[arg-type]
    ("bad-arg-name", PromptBuilder("s").add(Import("a", (("1x", "1"),))), InvalidNameError, "1x"),
    ("module-in-prompt", PromptBuilder("s").add(module("m")), PMLStructureError, "m"),  # type: ignore[arg-type]
    ("bad-schema-name", PromptBuilder("a b"), InvalidNameError, "a b"),
]


@pytest.mark.parametrize(
    ("builder", "error", "name"), [c[1:] for c in PROMPT_ERRORS], ids=[c[0] for c in PROMPT_ERRORS]
)
def test_prompt_builder_errors(builder: PromptBuilder, error: type[PMLError], name: str | None) -> None:
    with pytest.raises(error) as caught:
        builder.build()
    assert type(caught.value) is error
    if name is not None:
        assert caught.value.name == name


def test_union_node_equality_with_parser() -> None:
    built = SchemaBuilder("s").module("m", union(module("a", "A"), module("b", "B"))).build()
    parsed = parse_schema(
        "<schema name='s'><module name='m'><union><module name='a'>A</module>\n"
        "<module name='b'>B</module></union></module></schema>"
    )
    assert (
        built == parsed == Schema("s", (Module("m", (Union((Module("a", (Text("A"),)), Module("b", (Text("B"),)))),)),))
    )
