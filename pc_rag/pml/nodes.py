"""The PML document model: immutable nodes for schemas and prompts.

These nodes know nothing about XML or tokens: the parser and the Python
builder produce them, the layout consumes them.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal, TypeAlias

RoleName = Literal["system", "user", "assistant"]
ROLES: tuple[RoleName, ...] = ("system", "user", "assistant")


@dataclass(frozen=True)
class Text:
    """Literal text. In a schema it is anonymous (always included); in a prompt, uncached."""

    text: str


@dataclass(frozen=True)
class Param:
    """A placeholder inside a module that reserves ``length`` token positions for an argument."""

    name: str
    length: int


@dataclass(frozen=True)
class Module:
    """A named, cacheable span of a schema. Children may nest further modules and unions."""

    name: str
    children: tuple[SchemaNode, ...]


@dataclass(frozen=True)
class Union:
    """Mutually exclusive modules sharing one start position; its length is the longest member's."""

    members: tuple[Module, ...]


@dataclass(frozen=True)
class Scaffold:
    """Modules encoded together so that they attend to each other; used when all are imported."""

    name: str
    modules: tuple[Module, ...]


@dataclass(frozen=True)
class Role:
    """A chat turn (``<system>``, ``<user>``, ``<assistant>``), wrapped by the tokenizer's chat template."""

    role: RoleName
    children: tuple[SchemaNode, ...] | tuple[PromptNode, ...]


SchemaNode: TypeAlias = Text | Param | Module | Union | Scaffold | Role


@dataclass(frozen=True)
class Schema:
    """A named set of prompt modules and anonymous text, in document order."""

    name: str
    children: tuple[SchemaNode, ...]


@dataclass(frozen=True)
class Import:
    """A prompt's use of a module: arguments fill its params, children import nested modules."""

    name: str
    args: tuple[tuple[str, str], ...] = ()
    children: tuple[Import, ...] = ()


PromptNode: TypeAlias = Text | Import | Role


@dataclass(frozen=True)
class Prompt:
    """A request against a schema: imported modules plus uncached text, in document order."""

    schema: str
    children: tuple[PromptNode, ...] = field(default_factory=tuple)
