"""Structural rules of PML, shared by the XML parser, the Python builder and prompt programs.

A node tree is valid PML when it passes :func:`check_schema` or :func:`check_prompt`, and
:func:`tidy` applies the whitespace rule, so that every producer builds the same tree for the
same document. These rules know nothing about XML syntax, tokens or models; checking a
prompt against its schema is :mod:`pc_rag.pml.validate`'s job.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable
from typing import Any

from pc_rag.errors import DuplicateNameError, InvalidNameError, PMLStructureError
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

MAX_PARAM_LENGTH = 4096
"""Largest ``len`` a ``<param>`` may reserve, in tokens."""

RESERVED_NAMES = frozenset({"schema", "module", "union", "param", "scaffold", "system", "user", "assistant", "prompt"})
"""Tag names a module cannot take, since a prompt imports module ``x`` as ``<x/>``."""

XML_WHITESPACE = " \t\r\n"

LineOf = Callable[[object], int | None]
"""Maps a node to its source line, or None when unknown (e.g. nodes built in Python)."""

_START = (
    "A-Z_a-z\xc0-\xd6\xd8-\xf6\xf8-\u02ff\u0370-\u037d\u037f-\u1fff\u200c\u200d"
    "\u2070-\u218f\u2c00-\u2fef\u3001-\ud7ff\uf900-\ufdcf\ufdf0-\ufffd\U00010000-\U000effff"
)
_NAME = re.compile(f"[{_START}][{_START}\\-.0-9\xb7\u0300-\u036f\u203f-\u2040]*")
_ILLEGAL_CHAR = re.compile("[^\t\n\r\x20-\ud7ff\ue000-\ufffd\U00010000-\U0010ffff]")
_ALLOWED: dict[str, tuple[type, ...]] = {
    "schema": (Text, Module, Union, Scaffold, Role),
    "role": (Text, Module, Union),
    "module": (Text, Param, Module, Union),
}
_WHERE = {
    "schema": "a schema (outside any module)",
    "role": "a role",
    "module": "a module",
    "prompt": "a prompt",
    "import": "an import",
}


def _no_line(node: object) -> int | None:
    return None


def check_name(name: object, kind: str, *, line: int | None = None) -> None:
    """Raise InvalidNameError unless ``name`` is an XML name without a colon."""
    if not isinstance(name, str) or not _NAME.fullmatch(name):
        msg = f"{kind} name {name!r} is not a valid XML name"
        raise InvalidNameError(msg, name=str(name), line=line)


def check_module_name(name: object, kind: str = "module", *, line: int | None = None) -> None:
    """Like :func:`check_name`, and also reject the reserved tag names."""
    check_name(name, kind, line=line)
    if name in RESERVED_NAMES:
        msg = f"{kind} name {name!r} is reserved: it is a PML tag"
        raise InvalidNameError(msg, name=str(name), line=line)


def tidy(children: Iterable[Any]) -> tuple[Any, ...]:
    """Apply PML's whitespace rule to a list of children.

    Strings become Text, adjacent Text nodes merge, and empty text is dropped, as is text made
    only of XML whitespace unless it sits between two ``<param>`` elements. Nodes that are kept
    unmerged are returned as the same objects.
    """
    merged: list[Any] = []
    for child in children:
        node = Text(child) if isinstance(child, str) else child
        if isinstance(node, Text) and merged and isinstance(merged[-1], Text):
            merged[-1] = Text(merged[-1].text + node.text)
        else:
            merged.append(node)
    return tuple(node for i, node in enumerate(merged) if not _droppable(merged, i))


def _droppable(nodes: list[Any], i: int) -> bool:
    node = nodes[i]
    if not isinstance(node, Text) or node.text.strip(XML_WHITESPACE):
        return False
    between_params = 0 < i < len(nodes) - 1 and all(isinstance(nodes[j], Param) for j in (i - 1, i + 1))
    return node.text == "" or not between_params


def _tag(node: object) -> str:
    if isinstance(node, Text):
        return "text"
    if isinstance(node, Role):
        return f"<{node.role}>"
    if isinstance(node, Import):
        return f"import <{node.name}>"
    return f"<{type(node).__name__.lower()}>"


def _check_chars(text: object, line: int | None) -> None:
    if not isinstance(text, str) or _ILLEGAL_CHAR.search(text):
        msg = f"text {text!r} is not a string of XML characters"
        raise PMLStructureError(msg, line=line)


def _check_role(node: Role, line: int | None) -> None:
    if node.role not in ROLES:
        msg = f"unknown role {node.role!r}; expected one of {', '.join(ROLES)}"
        raise PMLStructureError(msg, name=str(node.role), line=line)


def check_schema(schema: Schema, line_of: LineOf = _no_line) -> None:
    """Raise a PMLError if ``schema`` breaks a PML rule.

    Rules: names are XML names; module and scaffold names are not reserved and are unique across
    the whole schema; params live in modules, have unique names there and a ``len`` in
    ``1..MAX_PARAM_LENGTH``; unions hold >= 1 module and scaffolds >= 2 (modules only); roles
    hold text, modules and unions and are not nested; scaffolds sit at the top level.
    """
    line = line_of(schema)
    check_name(schema.name, "schema", line=line)
    _SchemaChecker(line_of).children(schema.children, "schema", line)


class _SchemaChecker:
    def __init__(self, line_of: LineOf) -> None:
        self.line_of = line_of
        self.names: dict[str, str] = {}

    def children(self, nodes: Iterable[object], where: str, line: int | None) -> None:
        params: set[str] = set()
        for node in nodes:
            self.node(node, where, params, self.line_of(node) or line)

    def node(self, node: object, where: str, params: set[str], line: int | None) -> None:
        if not isinstance(node, _ALLOWED[where]):
            msg = f"{_tag(node)} cannot appear inside {_WHERE[where]}"
            raise PMLStructureError(msg, name=getattr(node, "name", None), line=line)
        if isinstance(node, Text):
            _check_chars(node.text, line)
        elif isinstance(node, Param):
            self.param(node, params, line)
        elif isinstance(node, Module):
            self.module(node, line)
        elif isinstance(node, Union):
            self.members(node.members, "union", 1, line)
        elif isinstance(node, Scaffold):
            self.declare(node.name, "scaffold", line)
            self.members(node.modules, "scaffold", 2, line)
        else:
            assert isinstance(node, Role)
            _check_role(node, line)
            self.children(node.children, "role", line)

    def param(self, node: Param, params: set[str], line: int | None) -> None:
        check_name(node.name, "param", line=line)
        if node.name in params:
            msg = f"param {node.name!r} is declared twice in the same module"
            raise DuplicateNameError(msg, name=node.name, line=line)
        params.add(node.name)
        if type(node.length) is not int or not 1 <= node.length <= MAX_PARAM_LENGTH:
            msg = f"param {node.name!r}: len must be an integer in 1..{MAX_PARAM_LENGTH}"
            raise PMLStructureError(f"{msg}, got {node.length!r}", name=node.name, line=line)

    def module(self, node: Module, line: int | None) -> None:
        self.declare(node.name, "module", line)
        self.children(node.children, "module", line)

    def members(self, nodes: Iterable[object], kind: str, minimum: int, line: int | None) -> None:
        nodes = tuple(nodes)
        if len(nodes) < minimum:
            msg = f"<{kind}> needs at least {minimum} module(s), got {len(nodes)}"
            raise PMLStructureError(msg, line=line)
        for node in nodes:
            at = self.line_of(node) or line
            if not isinstance(node, Module):
                msg = f"<{kind}> may only contain <module> elements, not {_tag(node)}"
                raise PMLStructureError(msg, name=getattr(node, "name", None), line=at)
            self.module(node, at)

    def declare(self, name: str, kind: str, line: int | None) -> None:
        check_module_name(name, kind, line=line)
        if name in self.names:
            msg = f"{kind} name {name!r} is already used by a {self.names[name]}"
            raise DuplicateNameError(msg, name=name, line=line)
        self.names[name] = kind


def check_prompt(prompt: Prompt, line_of: LineOf = _no_line) -> None:
    """Raise a PMLError if ``prompt`` breaks a PML rule (its schema is not consulted).

    Rules: roles hold text and imports and are not nested; imports hold only nested imports;
    import names are valid, unreserved module names; argument names are unique XML names.
    """
    line = line_of(prompt)
    check_name(prompt.schema, "schema", line=line)
    for node in prompt.children:
        _check_prompt_node(node, "prompt", line_of, line)


def _check_prompt_node(node: object, where: str, line_of: LineOf, line: int | None) -> None:
    at = line_of(node) or line
    if isinstance(node, Text) and where != "import":
        _check_chars(node.text, at)
    elif isinstance(node, Role) and where == "prompt":
        _check_role(node, at)
        for child in node.children:
            _check_prompt_node(child, "role", line_of, at)
    elif isinstance(node, Import):
        check_module_name(node.name, line=at)
        seen: set[str] = set()
        for arg, value in node.args:
            check_name(arg, "param", line=at)
            if arg in seen:
                msg = f"argument {arg!r} is given twice to module {node.name!r}"
                raise DuplicateNameError(msg, name=arg, line=at)
            seen.add(arg)
            _check_chars(value, at)
        for child in node.children:
            _check_prompt_node(child, "import", line_of, at)
    else:
        msg = f"{_tag(node)} cannot appear inside {_WHERE[where]}"
        raise PMLStructureError(msg, name=getattr(node, "name", None), line=at)
