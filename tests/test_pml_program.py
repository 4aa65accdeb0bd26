"""Prompt programs: Python functions read (never run) into schemas, and calls turned into prompts."""

from __future__ import annotations

import importlib.util
import textwrap
from pathlib import Path
from typing import Annotated

import pytest

from pc_rag.errors import (
    DuplicateNameError,
    InvalidNameError,
    PMLError,
    PMLStructureError,
    UnknownModuleError,
    UnknownParamError,
)
from pc_rag.pml import (
    MaxLen,
    PromptProgram,
    parse_prompt,
    parse_schema,
    prompt_program,
    system,
    text,
    to_xml,
    user,
    validate_prompt,
)


@prompt_program
def plan(duration: Annotated[str, MaxLen(4)]) -> None:
    text(f"Plan a trip of {duration} for the user.")


@prompt_program
def travel(city: str, question: str) -> None:
    """The paper's travel example; this docstring is not part of the prompt."""
    system("You are a helpful travel agent.")
    plan()
    if city == "tokyo":
        text("Tokyo is the capital of Japan ...")
    elif city == "paris":
        text("Paris is the capital of France ...")
    user(question)


TRAVEL_XML = """<schema name="travel">
  <system>You are a helpful travel agent.</system>
  <module name="plan">Plan a trip of <param name="duration" len="4"/> for the user.</module>
  <union>
    <module name="tokyo">Tokyo is the capital of Japan ...</module>
    <module name="paris">Paris is the capital of France ...</module>
  </union>
</schema>"""


def test_travel_program_schema_equals_the_xml() -> None:
    assert isinstance(travel, PromptProgram)
    assert travel.schema == parse_schema(TRAVEL_XML)
    assert parse_schema(to_xml(travel.schema)) == travel.schema


def test_travel_program_prompt() -> None:
    prompt = travel.prompt(city="tokyo", duration="3 days", question="Highlight the food markets.")
    expected = (
        '<prompt schema="travel"><plan duration="3 days"/><tokyo/><user>Highlight the food markets.</user></prompt>'
    )
    assert prompt == parse_prompt(expected)
    assert parse_prompt(to_xml(prompt)) == prompt
    validate_prompt(prompt, travel.schema)


def test_missing_arguments_select_nothing_and_leave_params_empty() -> None:
    assert to_xml(travel.prompt()) == '<prompt schema="travel">\n  <plan/>\n  <user/>\n</prompt>'


@prompt_program
def trip(duration: Annotated[str, MaxLen(4)], food: bool, city: str, user: str, vegan: bool = False) -> None:
    system("You plan trips.")
    text("Always answer in English. ")
    if food:
        text(f"Plan {duration} of food, ", "please!")
        if vegan:
            text("Only vegan places.")
    match city:
        case "tokyo":
            text("Tokyo.")
            plan()
        case "paris":
            pass
    text("Request: ", user)
    user(f"{user} Thanks.")


def test_flags_match_and_nested_programs() -> None:
    schema = trip.schema
    assert [type(node).__name__ for node in schema.children] == ["Role", "Text", "Module", "Union"]
    assert to_xml(schema).count("<module") == 5
    assert parse_schema(to_xml(schema)) == schema
    prompt = trip.prompt(food=True, vegan=True, city="tokyo", duration="2 days", user="Where?")
    assert to_xml(prompt) == (
        '<prompt schema="trip">\n  <food duration="2 days"><vegan/></food>\n  <tokyo><plan duration="2 days"/></tokyo>'
        "Request: Where?<user>Where? Thanks.</user>\n</prompt>"
    )
    validate_prompt(prompt, schema)
    assert trip.prompt(food=False, city="paris", user="Q").children[0].name == "paris"


def test_prompt_argument_errors() -> None:
    with pytest.raises(UnknownParamError) as caught:
        travel.prompt(town="tokyo")
    assert caught.value.name == "town"
    with pytest.raises(UnknownModuleError) as caught:
        travel.prompt(city="rome")
    assert caught.value.name == "rome"
    with pytest.raises(PMLError):
        travel.prompt(question=3)


HEADER = """\
from typing import Annotated
from pc_rag.pml import MaxLen, prompt_program, text, system, user

"""

PROGRAM_ERRORS = [
    # (id, body, error, name); the offending line ends with "# <-"
    ("loop", "def p(x: str):\n    for i in x:  # <-\n        text('a')", PMLStructureError, None),
    ("assignment", "def p():\n    text('a')\n    y = 1  # <-", PMLStructureError, None),
    ("bare-string", "def p():\n    '''doc'''\n    'not text'  # <-", PMLStructureError, None),
    ("bare-f-string", "def p(x: str):\n    f'{x}'  # <-", PMLStructureError, None),
    ("unbounded-in-module", "def p(food: bool, q: str):\n    if food:\n        text(q)  # <-", PMLStructureError, None),
    ("else", "def p(c):\n    if c == 'a':\n        pass\n    else:\n        text('b')  # <-", PMLStructureError, None),
    (
        "flag-with-else",
        "def p(c: bool):\n    if c:\n        pass\n    else:\n        pass  # <-",
        PMLStructureError,
        None,
    ),
    (
        "two-subjects",
        "def p(c, d):\n    if c == 'a':\n        pass\n    elif d == 'b':  # <-\n        pass",
        PMLStructureError,
        None,
    ),
    (
        "not-equal",
        "def p(c):\n    if c != 'a':  # <-\n        pass\n    elif c == 'b':\n        pass",
        PMLStructureError,
        None,
    ),
    (
        "wildcard-case",
        "def p(c):\n    match c:\n        case 'a':\n            pass\n        case _:  # <-\n            pass",
        PMLStructureError,
        None,
    ),
    (
        "guarded-case",
        "def p(c, d):\n    match c:\n        case 'a' if d:  # <-\n            pass",
        PMLStructureError,
        None,
    ),
    ("not-a-parameter", "def p():\n    if weather:  # <-\n        text('x')", PMLStructureError, None),
    ("unknown-call", "def p():\n    print('x')  # <-", PMLStructureError, None),
    ("role-in-module", "def p(f: bool):\n    if f:\n        user('x')  # <-", PMLStructureError, None),
    (
        "format-spec",
        "def p(f: bool, d: Annotated[str, MaxLen(2)]):\n    if f:\n        text(f'{d:>4}')  # <-",
        PMLStructureError,
        None,
    ),
    (
        "expression",
        "def p(f: bool, d: Annotated[str, MaxLen(2)]):\n    if f:\n        text(f'{d.upper()}')  # <-",
        PMLStructureError,
        None,
    ),
    ("non-str-text", "def p():\n    text(1)  # <-", PMLStructureError, None),
    ("text-keyword", "def p():\n    text(x='a')  # <-", PMLStructureError, None),
    ("untyped-text", "def p(f: bool, x):\n    if f:\n        text(x)  # <-", PMLStructureError, None),
    (
        "maxlen-not-literal",
        "N = 3\ndef p(\n    d: Annotated[str, MaxLen(N)],  # <-\n):\n    pass",
        PMLStructureError,
        "d",
    ),
    (
        "duplicate-module",
        "def p(f: bool):\n    if f:\n        pass\n    if f:  # <-\n        pass",
        DuplicateNameError,
        "f",
    ),
    (
        "duplicate-member",
        "def p(c):\n    match c:\n        case 'a':\n            pass\n        case 'a':  # <-\n            pass",
        DuplicateNameError,
        "a",
    ),
    (
        "duplicate-param",
        "def p(f: bool, d: Annotated[str, MaxLen(2)]):\n    if f:\n        text(d, d)  # <-",
        DuplicateNameError,
        "d",
    ),
    ("invalid-member-name", "def p(c):\n    if c == 'new york':  # <-\n        pass", InvalidNameError, "new york"),
    (
        "reserved-member-name",
        "def p(c):\n    match c:\n        case 'user':  # <-\n            pass",
        InvalidNameError,
        "user",
    ),
    (
        "program-with-arguments",
        "@prompt_program\ndef q(x: str):\n    pass\n\ndef p(x: str):\n    q(x)  # <-",
        PMLStructureError,
        None,
    ),
]


def load(tmp_path: Path, body: str) -> None:
    """Write a module that decorates ``p`` and import it (so that its source is on disk)."""
    path = tmp_path / "program_under_test.py"
    path.write_text(HEADER + body.replace("def p(", "@prompt_program\ndef p(") + "\n")
    spec = importlib.util.spec_from_file_location(f"program_{tmp_path.name}", path)
    assert spec is not None and spec.loader is not None
    spec.loader.exec_module(importlib.util.module_from_spec(spec))


@pytest.mark.parametrize(("body", "error", "name"), [c[1:] for c in PROGRAM_ERRORS], ids=[c[0] for c in PROGRAM_ERRORS])
def test_program_errors(tmp_path: Path, body: str, error: type[PMLError], name: str | None) -> None:
    with pytest.raises(error) as caught:
        load(tmp_path, body)
    assert type(caught.value) is error
    lines = (tmp_path / "program_under_test.py").read_text().splitlines()
    assert caught.value.line == 1 + next(i for i, line in enumerate(lines) if line.endswith("# <-"))
    if name is not None:
        assert caught.value.name == name


def test_program_in_a_file_works(tmp_path: Path) -> None:
    load(tmp_path, "def p(f: bool, d: Annotated[str, MaxLen(2)]):\n    if f:\n        text('x', d)")


def test_program_without_source() -> None:
    namespace: dict[str, object] = {}
    exec(textwrap.dedent("def p():\n    text('x')\n"), {"text": text}, namespace)
    with pytest.raises(PMLError):
        prompt_program(namespace["p"])  # type: ignore[arg-type]


def test_only_plain_functions_are_programs() -> None:
    async def coroutine() -> None:
        text("x")

    with pytest.raises(PMLStructureError):
        prompt_program(coroutine)
    with pytest.raises(PMLError):
        prompt_program(lambda: text("x"))


def test_local_programs_and_qualified_annotations() -> None:
    import typing

    from pc_rag import pml

    @prompt_program
    def inner(size: typing.Annotated[str, pml.MaxLen(tokens=3)]) -> None:
        text("Size ", size)

    @prompt_program
    def outer(extra: bool) -> None:
        if extra:
            inner()

    assert to_xml(outer.schema) == (
        '<schema name="outer">\n  <module name="extra"><module name="inner">Size <param name="size" len="3"/>'
        "</module></module>\n</schema>"
    )
    prompt = outer.prompt(extra=True, size="big")
    assert to_xml(prompt) == '<prompt schema="outer">\n  <extra><inner size="big"/></extra>\n</prompt>'
    validate_prompt(prompt, outer.schema)
