"""Parsing PML schemas and prompts: the document model, the whitespace rule, and every rejection."""

from __future__ import annotations

import pytest
from pml_examples import PROMPT_XML, TRAVEL_XML

from pc_rag.errors import (
    DuplicateNameError,
    InvalidNameError,
    PMLError,
    PMLStructureError,
    PMLSyntaxError,
)
from pc_rag.pml import (
    MAX_DEPTH,
    MAX_SOURCE_BYTES,
    Import,
    Module,
    Param,
    Prompt,
    Role,
    Scaffold,
    Schema,
    Text,
    Union,
    parse_prompt,
    parse_schema,
)

TRAVEL_NODES = Schema(
    "travel",
    (
        Role("system", (Text("You are a helpful travel agent."),)),
        Module("plan", (Text("Plan a trip of "), Param("duration", 4), Text(" for the user."))),
        Union(
            (
                Module("tokyo", (Text("Tokyo is the capital of Japan ..."),)),
                Module("paris", (Text("Paris is the capital of France ..."),)),
            )
        ),
        Scaffold("pair", (Module("a", (Text("A text"),)), Module("b", (Text("B text"),)))),
    ),
)


def test_travel_schema_parses_to_the_expected_nodes() -> None:
    assert parse_schema(TRAVEL_XML) == TRAVEL_NODES


def test_travel_prompt_parses_to_the_expected_nodes() -> None:
    assert parse_prompt(PROMPT_XML) == Prompt(
        "travel",
        (
            Import("plan", (("duration", "3 days"),)),
            Import("tokyo"),
            Role("user", (Text("Highlight the food markets."),)),
        ),
    )


def test_prompt_keeps_nested_imports_argument_order_and_imports_in_roles() -> None:
    source = """<prompt schema="s">
      Before. <outer b="2" a="1">
        <inner x="&lt;&amp;&gt;"/>
      </outer>
      <system>Hi <m/> there</system>
    </prompt>"""
    assert parse_prompt(source).children == (
        Text("\n      Before. "),
        Import("outer", (("b", "2"), ("a", "1")), (Import("inner", (("x", "<&>"),)),)),
        Role("system", (Text("Hi "), Import("m"), Text(" there"))),
    )


@pytest.mark.parametrize(
    ("body", "children"),
    [
        ("<module name='m'>  padded  </module>", (Module("m", (Text("  padded  "),)),)),
        ("<module name='m'> \n\t </module>", (Module("m", ()),)),
        ("<module name='m'>\n  <module name='n'>x</module>\n</module>", (Module("m", (Module("n", (Text("x"),)),)),)),
        (
            "<module name='m'><param name='a' len='2'/> <param name='b' len='3'/></module>",
            (Module("m", (Param("a", 2), Text(" "), Param("b", 3))),),
        ),
        (
            "<module name='m'> <param name='a' length='2'/>\n</module>",
            (Module("m", (Param("a", 2),)),),
        ),
        ("text <!-- a comment --> more<?pi x?>", (Text("\n  text  more\n"),)),
        ("<module name='m'><![CDATA[<b>&</b>]]></module>", (Module("m", (Text("<b>&</b>"),)),)),
        ("a&#10;b &amp; c", (Text("\n  a\nb & c\n"),)),
        (
            "<user>Ask: <union><module name='x'>X</module></union></user>",
            (Role("user", (Text("Ask: "), Union((Module("x", (Text("X"),)),)))),),
        ),
    ],
)
def test_whitespace_rule_and_text(body: str, children: tuple) -> None:
    assert parse_schema(f'<schema name="s">\n  {body}\n</schema>').children == children


def test_same_param_name_in_two_modules_and_xml_declaration_are_fine() -> None:
    source = """<?xml version="1.0" encoding="latin-1"?>
<schema name="s"><module name="a"><param name="p" len="1"/></module>
<module name="b"><param name="p" len="2"/></module></schema>"""
    assert parse_schema(source).children == (Module("a", (Param("p", 1),)), Module("b", (Param("p", 2),)))


def test_max_depth_is_accepted() -> None:
    depth = MAX_DEPTH - 1  # the schema element is level 1
    source = "<schema name='s'>" + "".join(f"<module name='m{i}'>" for i in range(depth))
    source += "x" + "</module>" * depth + "</schema>"
    assert parse_schema(source).name == "s"


BILLION_LAUGHS = """<?xml version="1.0"?>
<!DOCTYPE schema [
  <!ENTITY lol "lol">
  <!ENTITY lol2 "&lol;&lol;&lol;&lol;&lol;&lol;&lol;&lol;&lol;&lol;">
  <!ENTITY lol3 "&lol2;&lol2;&lol2;&lol2;&lol2;&lol2;&lol2;&lol2;&lol2;&lol2;">
]>
<schema name="s"><module name="m">&lol3;</module></schema>"""

DEEP = "<schema name='s'>" + "".join(f"<module name='m{i}'>" for i in range(MAX_DEPTH))  # one level too many
DEEP += "</module>" * MAX_DEPTH + "</schema>"


def in_schema(body: str) -> str:
    return f"<schema name='s'>{body}</schema>"


def in_module(body: str) -> str:
    return in_schema(f"<module name='m'>{body}</module>")


PAIR = "<module name='a'/><module name='b'/>"

SCHEMA_ERRORS = [
    # (id, source, error, line, name)
    ("malformed", "<schema name='s'>\n<module name='m'>\n</schema>", PMLSyntaxError, 3, None),
    ("empty", "", PMLSyntaxError, 1, None),
    ("not-xml", "hello", PMLSyntaxError, 1, None),
    ("billion-laughs", BILLION_LAUGHS, PMLSyntaxError, 1, None),
    ("doctype", "<!DOCTYPE schema>\n<schema name='s'/>", PMLSyntaxError, 1, None),
    ("undefined-entity", in_schema("\n&foo;"), PMLSyntaxError, 2, None),
    ("too-deep", DEEP, PMLSyntaxError, 1, None),
    ("too-large", in_schema("x" * MAX_SOURCE_BYTES), PMLSyntaxError, None, None),
    ("wrong-root", "<prompt schema='s'/>", PMLStructureError, 1, "prompt"),
    ("no-name", "<schema/>", PMLStructureError, 1, "schema"),
    ("unknown-element", in_schema("\n<foo/>"), PMLStructureError, 2, "foo"),
    ("unknown-attribute", in_schema("\n<module name='m' x='1'/>"), PMLStructureError, 2, "x"),
    ("namespace", in_schema("<m:module xmlns:m='u' name='m'/>"), PMLStructureError, 1, None),
    ("duplicate-module", in_schema("\n<module name='m'/>\n<module name='m'/>"), DuplicateNameError, 3, "m"),
    ("duplicate-nested-module", in_module("\n<union><module name='m'/></union>"), DuplicateNameError, 2, "m"),
    ("duplicate-in-role", in_schema("<module name='m'/>\n<user><module name='m'/></user>"), DuplicateNameError, 2, "m"),
    (
        "duplicate-in-scaffold",
        in_schema(f"<module name='a'/>\n<scaffold name='p'>{PAIR}</scaffold>"),
        DuplicateNameError,
        2,
        "a",
    ),
    (
        "module-named-like-scaffold",
        in_schema(f"<scaffold name='p'>{PAIR}</scaffold>\n<module name='p'/>"),
        DuplicateNameError,
        2,
        "p",
    ),
    ("duplicate-param", in_module("\n<param name='p' len='1'/><param name='p' len='2'/>"), DuplicateNameError, 2, "p"),
    ("reserved-name", in_schema("\n<module name='user'/>"), InvalidNameError, 2, "user"),
    ("reserved-scaffold", in_schema("<scaffold name='union'/>"), InvalidNameError, 1, "union"),
    ("digit-name", in_schema("<module name='1m'/>"), InvalidNameError, 1, "1m"),
    ("space-name", in_schema("<module name='a b'/>"), InvalidNameError, 1, "a b"),
    ("colon-name", in_schema("<module name='a:b'/>"), InvalidNameError, 1, "a:b"),
    ("bad-param-name", in_module("<param name='-p' len='1'/>"), InvalidNameError, 1, "-p"),
    ("bad-schema-name", "<schema name=''/>", InvalidNameError, 1, ""),
    ("param-outside-module", in_schema("\n<param name='p' len='1'/>"), PMLStructureError, 2, "p"),
    ("param-in-role", in_schema("<user>\n<param name='p' len='1'/></user>"), PMLStructureError, 2, "p"),
    ("param-len-zero", in_module("\n<param name='p' len='0'/>"), PMLStructureError, 2, "p"),
    ("param-len-negative", in_module("<param name='p' len='-1'/>"), PMLStructureError, 1, "p"),
    ("param-len-word", in_module("<param name='p' len='four'/>"), PMLStructureError, 1, "p"),
    ("param-len-huge", in_module("<param name='p' length='4097'/>"), PMLStructureError, 1, "p"),
    ("param-len-giant", in_module("<param name='p' len='9999999999999'/>"), PMLStructureError, 1, "p"),
    ("param-no-len", in_module("<param name='p'/>"), PMLStructureError, 1, "p"),
    ("param-len-and-length", in_module("<param name='p' len='1' length='1'/>"), PMLStructureError, 1, "p"),
    ("param-no-name", in_module("<param len='1'/>"), PMLStructureError, 1, "param"),
    ("param-with-children", in_module("<param name='p' len='1'>x</param>"), PMLStructureError, 1, "p"),
    ("union-text", in_schema("<union>\n<module name='a'/> text </union>"), PMLStructureError, 2, None),
    ("union-param", in_module("<union><param name='p' len='1'/></union>"), PMLStructureError, 1, "p"),
    ("union-in-union", in_schema("<union><union><module name='a'/></union></union>"), PMLStructureError, 1, None),
    ("empty-union", in_schema("\n<union> </union>"), PMLStructureError, 2, None),
    ("union-attribute", in_schema("<union name='u'><module name='a'/></union>"), PMLStructureError, 1, "name"),
    (
        "scaffold-one-module",
        in_schema("\n<scaffold name='p'><module name='a'/></scaffold>"),
        PMLStructureError,
        2,
        None,
    ),
    ("scaffold-in-module", in_module(f"\n<scaffold name='p'>{PAIR}</scaffold>"), PMLStructureError, 2, "p"),
    ("nested-role", in_schema("<system>\n<user>hi</user></system>"), PMLStructureError, 2, None),
    ("role-in-module", in_module("\n<user>hi</user>"), PMLStructureError, 2, None),
    ("role-attribute", in_schema("<user who='me'>hi</user>"), PMLStructureError, 1, "who"),
]


PROMPT_ERRORS = [
    ("malformed", "<prompt schema='s'>\n<a></b></prompt>", PMLSyntaxError, 2, None),
    ("doctype", "<!DOCTYPE prompt>\n<prompt schema='s'/>", PMLSyntaxError, 1, None),
    ("wrong-root", "<schema name='s'/>", PMLStructureError, 1, "schema"),
    ("no-schema", "<prompt name='s'/>", PMLStructureError, 1, "name"),
    ("text-inside-import", "<prompt schema='s'>\n<plan>3 days</plan></prompt>", PMLStructureError, 2, None),
    ("text-inside-nested-import", "<prompt schema='s'><a>\n<b> x </b></a></prompt>", PMLStructureError, 2, None),
    ("role-inside-import", "<prompt schema='s'><a>\n<user>hi</user></a></prompt>", PMLStructureError, 2, None),
    ("nested-role", "<prompt schema='s'><system>\n<user>hi</user></system></prompt>", PMLStructureError, 2, None),
    ("reserved-import", "<prompt schema='s'>\n<module/></prompt>", InvalidNameError, 2, "module"),
    ("role-attribute", "<prompt schema='s'><user x='1'>hi</user></prompt>", PMLStructureError, 1, "x"),
    ("namespaced-import", "<prompt schema='s' xmlns='u'><a/></prompt>", PMLStructureError, 1, None),
]


ERROR_CASES = [(parse_schema, *case) for case in SCHEMA_ERRORS] + [(parse_prompt, *case) for case in PROMPT_ERRORS]


@pytest.mark.parametrize(
    ("parse", "source", "error", "line", "name"),
    [(c[0], *c[2:]) for c in ERROR_CASES],
    ids=[f"{c[0].__name__.removeprefix('parse_')}-{c[1]}" for c in ERROR_CASES],
)
def test_errors(parse, source: str, error: type[PMLError], line: int | None, name: str | None) -> None:
    with pytest.raises(error) as caught:
        parse(source)
    assert type(caught.value) is error
    assert caught.value.line == line
    if name is not None:
        assert caught.value.name == name


def test_external_entity_is_never_resolved(tmp_path) -> None:
    secret = tmp_path / "secret.txt"
    secret.write_text("TOP-SECRET")
    source = f"""<!DOCTYPE schema [<!ENTITY x SYSTEM "file://{secret}">]>
<schema name="s"><module name="m">&x;</module></schema>"""
    with pytest.raises(PMLSyntaxError) as caught:
        parse_schema(source)
    assert "TOP-SECRET" not in str(caught.value)
    passwd = '<!DOCTYPE p [<!ENTITY x SYSTEM "file:///etc/passwd">]><prompt schema="s"><a v="&x;"/></prompt>'
    with pytest.raises(PMLSyntaxError) as caught:
        parse_prompt(passwd)
    assert "root:" not in str(caught.value)


def test_error_message_carries_line_and_column() -> None:
    with pytest.raises(PMLSyntaxError) as caught:
        parse_schema("<schema name='s'>\n  <module name='m'>\n</schema>")
    assert caught.value.column is not None
    assert "line 3" in str(caught.value)


@pytest.mark.parametrize(
    "source",
    [
        "\x00",
        "<",
        "<schema name='s'",
        "<?xml version='2.0'?><schema name='s'/>",
        "\ufeff<x",
        "<schema name='s'>\ud800</schema>",
    ],
)
def test_no_lxml_exception_escapes(source: str) -> None:
    with pytest.raises(PMLError):
        parse_schema(source)
