"""Build PML schemas and prompts in Python, without writing XML.

Strings become :class:`~pc_rag.pml.nodes.Text` and the parser's whitespace rule is applied,
so a builder produces exactly the tree that parsing the equivalent XML would. ``build()``
checks the result with the same rules as the parser (:mod:`pc_rag.pml.rules`); the builder
knows nothing about tokens, models, or whether a prompt matches its schema.

Example::

    schema = (
        SchemaBuilder("travel")
        .system("You are a helpful travel agent.")
        .module("plan", "Plan a trip of ", param("duration", 4), " for the user.")
        .union(module("tokyo", "Tokyo ..."), module("paris", "Paris ..."))
        .build()
    )
    prompt = PromptBuilder("travel").use("plan", duration="3 days").use("tokyo").build()
"""

from __future__ import annotations

from pc_rag.pml.nodes import (
    Import,
    Module,
    Param,
    Prompt,
    PromptNode,
    Role,
    RoleName,
    Scaffold,
    Schema,
    SchemaNode,
    Text,
    Union,
)
from pc_rag.pml.rules import check_prompt, check_schema, tidy

Child = str | SchemaNode | PromptNode
"""What the builders accept as content: strings (text) or nodes."""


def text(*parts: str) -> Text:
    """Literal text; the parts are concatenated."""
    return Text("".join(parts))


def param(name: str, length: int) -> Param:
    """A ``<param>`` reserving ``length`` tokens for an argument (only valid inside a module)."""
    return Param(name, length)


def module(name: str, *children: str | SchemaNode) -> Module:
    """A named ``<module>`` of text, params, nested modules and unions."""
    return Module(name, tidy(children))


def union(*modules: Module) -> Union:
    """A ``<union>`` of mutually exclusive modules."""
    return Union(tuple(modules))


def scaffold(name: str, *modules: Module) -> Scaffold:
    """A ``<scaffold>``: modules encoded together so that they attend to each other."""
    return Scaffold(name, tuple(modules))


def role(name: RoleName, *children: Child) -> Role:
    """A chat turn; in a schema it holds text, modules and unions, in a prompt text and imports."""
    return Role(name, tidy(children))


def system(*children: Child) -> Role:
    """A ``<system>`` turn."""
    return role("system", *children)


def user(*children: Child) -> Role:
    """A ``<user>`` turn."""
    return role("user", *children)


def assistant(*children: Child) -> Role:
    """An ``<assistant>`` turn."""
    return role("assistant", *children)


def use(name: str, /, *children: Import, **args: str) -> Import:
    """Import module ``name`` into a prompt, filling its params from ``args`` (in order given)."""
    return Import(name, tuple(args.items()), tidy(children))


class SchemaBuilder:
    """Accumulates the top-level content of a schema, in order; methods return the builder."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.children: list[Child] = []

    def add(self, *children: str | SchemaNode) -> SchemaBuilder:
        """Append text or nodes built with the free functions of this module."""
        self.children.extend(children)
        return self

    def text(self, *parts: str) -> SchemaBuilder:
        """Append anonymous text, always included in prompts."""
        return self.add(text(*parts))

    def module(self, name: str, *children: str | SchemaNode) -> SchemaBuilder:
        """Append a module; see :func:`module`."""
        return self.add(module(name, *children))

    def union(self, *modules: Module) -> SchemaBuilder:
        """Append a union; see :func:`union`."""
        return self.add(union(*modules))

    def scaffold(self, name: str, *modules: Module) -> SchemaBuilder:
        """Append a scaffold; see :func:`scaffold`."""
        return self.add(scaffold(name, *modules))

    def system(self, *children: str | SchemaNode) -> SchemaBuilder:
        """Append a ``<system>`` turn."""
        return self.add(system(*children))

    def user(self, *children: str | SchemaNode) -> SchemaBuilder:
        """Append a ``<user>`` turn."""
        return self.add(user(*children))

    def assistant(self, *children: str | SchemaNode) -> SchemaBuilder:
        """Append an ``<assistant>`` turn."""
        return self.add(assistant(*children))

    def build(self) -> Schema:
        """The schema; raise a PMLError if it breaks a PML rule."""
        schema = Schema(self.name, tidy(self.children))
        check_schema(schema)
        return schema


class PromptBuilder:
    """Accumulates a prompt's imports and uncached text, in order; methods return the builder."""

    def __init__(self, schema: str) -> None:
        self.schema = schema
        self.children: list[Child] = []

    def add(self, *children: str | PromptNode) -> PromptBuilder:
        """Append text or nodes built with :func:`use` and the role functions."""
        self.children.extend(children)
        return self

    def text(self, *parts: str) -> PromptBuilder:
        """Append uncached text."""
        return self.add(text(*parts))

    def use(self, name: str, /, *children: Import, **args: str) -> PromptBuilder:
        """Import a module; see :func:`use`."""
        return self.add(use(name, *children, **args))

    def system(self, *children: str | PromptNode) -> PromptBuilder:
        """Append a ``<system>`` turn of text and imports."""
        return self.add(system(*children))

    def user(self, *children: str | PromptNode) -> PromptBuilder:
        """Append a ``<user>`` turn of text and imports."""
        return self.add(user(*children))

    def assistant(self, *children: str | PromptNode) -> PromptBuilder:
        """Append an ``<assistant>`` turn of text and imports."""
        return self.add(assistant(*children))

    def build(self) -> Prompt:
        """The prompt; raise a PMLError if it breaks a PML rule (the schema is not consulted)."""
        prompt = Prompt(self.schema, tidy(self.children))
        check_prompt(prompt)
        return prompt
