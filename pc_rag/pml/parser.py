"""Parse PML (XML) schemas and prompts into :mod:`pc_rag.pml.nodes` trees.

Parsing is hardened: no DTD (a DOCTYPE is rejected, so entities are never declared or
resolved), no network, no comments or processing instructions, a bounded source size and
nesting depth, and every lxml error becomes a :class:`~pc_rag.errors.PMLSyntaxError`.

Whitespace rule: text is kept exactly as written, except that a text node made only of XML
whitespace (space, tab, CR, LF) is dropped, unless it sits between two ``<param>`` elements.
So indentation between ``<module>``, ``<union>``, ``<scaffold>``, role and import elements
vanishes, while text inside a module or role that is not whitespace-only (leading and
trailing spaces included) is kept verbatim.

The parser knows nothing about tokens, models, or whether a prompt matches its schema.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any

from lxml import etree

from pc_rag.errors import PMLStructureError, PMLSyntaxError
from pc_rag.pml.nodes import (
    ROLES,
    Import,
    Module,
    Param,
    Prompt,
    Role,
    Scaffold,
    Schema,
    Text,
    Union,
)
from pc_rag.pml.rules import XML_WHITESPACE, check_prompt, check_schema, tidy

MAX_SOURCE_BYTES = 2 * 1024 * 1024
"""Largest PML source accepted, in UTF-8 bytes."""

MAX_DEPTH = 32
"""Deepest element nesting accepted (the root element is depth 1)."""

_LENGTH = re.compile(r"[0-9]{1,9}")


def parse_schema(source: str) -> Schema:
    """Parse a ``<schema name="...">`` document; raise a PMLError if it is not valid PML."""
    return _Reader().schema(_parse_root(source, "schema"))


def parse_prompt(source: str) -> Prompt:
    """Parse a ``<prompt schema="...">`` document; raise a PMLError if it is not valid PML.

    The prompt is not checked against its schema: see :func:`pc_rag.pml.validate_prompt`.
    """
    return _Reader().prompt(_parse_root(source, "prompt"))


def _parse_root(source: str, tag: str) -> Any:
    data = source.encode("utf-8", "surrogatepass")  # lxml reports lone surrogates with their position
    if len(data) > MAX_SOURCE_BYTES:
        msg = f"PML source is {len(data)} bytes, more than the limit of {MAX_SOURCE_BYTES}"
        raise PMLSyntaxError(msg)
    parser = etree.XMLParser(
        encoding="utf-8",
        resolve_entities=False,
        no_network=True,
        load_dtd=False,
        dtd_validation=False,
        huge_tree=False,
        remove_comments=True,
        remove_pis=True,
    )
    try:
        root = etree.fromstring(data, parser)
    except etree.XMLSyntaxError as e:
        line, column = e.position
        msg = f"malformed XML: {e.msg}"
        raise PMLSyntaxError(msg, line=line, column=column) from e
    except (etree.LxmlError, ValueError) as e:
        msg = f"unreadable XML: {e}"
        raise PMLSyntaxError(msg) from e
    docinfo = root.getroottree().docinfo
    if docinfo.doctype or docinfo.internalDTD is not None:
        msg = "DOCTYPE and DTD declarations (hence entities) are not allowed in PML"
        raise PMLSyntaxError(msg, line=1)
    if root.tag != tag:
        msg = f"the root element must be <{tag}>, not <{root.tag}>"
        raise PMLStructureError(msg, name=str(root.tag), line=root.sourceline)
    return root


def _attrs(el: Any, required: tuple[str, ...], optional: tuple[str, ...] = ()) -> dict[str, str]:
    attrs = dict(el.attrib)
    for key in attrs:
        if key not in required and key not in optional:
            msg = f"<{el.tag}> has no attribute {key!r}"
            raise PMLStructureError(msg, name=key, line=el.sourceline)
    for key in required:
        if key not in attrs:
            msg = f"<{el.tag}> needs a {key!r} attribute"
            raise PMLStructureError(msg, name=el.tag, line=el.sourceline)
    return attrs


def _param(el: Any) -> Param:
    attrs = _attrs(el, ("name",), ("len", "length"))
    name = attrs["name"]
    if ("len" in attrs) == ("length" in attrs):
        msg = f"param {name!r} needs exactly one of the attributes 'len' and 'length'"
        raise PMLStructureError(msg, name=name, line=el.sourceline)
    if (el.text or "").strip(XML_WHITESPACE) or len(el):
        msg = f"param {name!r} must be empty: <param name=... len=.../>"
        raise PMLStructureError(msg, name=name, line=el.sourceline)
    value = attrs.get("len", attrs.get("length", ""))
    if not _LENGTH.fullmatch(value):
        msg = f"param {name!r}: len must be a positive integer, got {value!r}"
        raise PMLStructureError(msg, name=name, line=el.sourceline)
    return Param(name, int(value))


class _Reader:
    """Maps elements to nodes, remembering each node's source line for error messages."""

    def __init__(self) -> None:
        self.lines: dict[int, int] = {}

    def line_of(self, node: object) -> int | None:
        return self.lines.get(id(node))

    def keep(self, node: Any, line: int | None) -> Any:
        if line is not None:
            self.lines[id(node)] = line
        return node

    def schema(self, root: Any) -> Schema:
        name = _attrs(root, ("name",))["name"]
        schema = Schema(name, self.content(root, 1, self.schema_node))
        check_schema(self.keep(schema, root.sourceline), self.line_of)
        return schema

    def prompt(self, root: Any) -> Prompt:
        name = _attrs(root, ("schema",))["schema"]
        prompt = Prompt(name, self.content(root, 1, self.prompt_node))
        check_prompt(self.keep(prompt, root.sourceline), self.line_of)
        return prompt

    def content(self, el: Any, depth: int, make: Callable[[Any, int], Any]) -> tuple[Any, ...]:
        """The element's text and children as nodes, with the whitespace rule applied."""
        items = []
        if el.text:
            items.append(self.keep(Text(el.text), el.sourceline))
        for child in el:
            if depth >= MAX_DEPTH:
                msg = f"elements are nested deeper than {MAX_DEPTH} levels"
                raise PMLSyntaxError(msg, line=child.sourceline)
            if not isinstance(child.tag, str) or child.tag.startswith("{"):
                msg = "XML namespaces and entity references are not supported in PML"
                raise PMLStructureError(msg, line=child.sourceline)
            items.append(self.keep(make(child, depth + 1), child.sourceline))
            if child.tail:
                items.append(self.keep(Text(child.tail), child.sourceline))
        return tidy(items)

    def schema_node(self, el: Any, depth: int) -> Any:
        tag = el.tag
        if tag == "param":
            return _param(el)
        if tag == "module":
            return Module(_attrs(el, ("name",))["name"], self.content(el, depth, self.schema_node))
        if tag == "union":
            _attrs(el, ())
            return Union(self.content(el, depth, self.schema_node))
        if tag == "scaffold":
            name = _attrs(el, ("name",))["name"]
            return Scaffold(name, self.content(el, depth, self.schema_node))
        if tag in ROLES:
            _attrs(el, ())
            return Role(tag, self.content(el, depth, self.schema_node))
        msg = f"unknown element <{tag}> in a schema"
        raise PMLStructureError(msg, name=tag, line=el.sourceline)

    def prompt_node(self, el: Any, depth: int) -> Any:
        if el.tag in ROLES:
            _attrs(el, ())
            return Role(el.tag, self.content(el, depth, self.prompt_node))
        args = tuple((str(key), str(value)) for key, value in el.attrib.items())
        return Import(el.tag, args, self.content(el, depth, self.prompt_node))
