"""Check a prompt against its schema, and index a schema's modules.

Validation knows the schema's structure but nothing about tokens: argument lengths are checked
by :func:`check_argument_lengths` with a token counter supplied by the caller. Schemas passed
here are assumed to be valid PML (as produced by the parser, the builder or a prompt program).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass

from pc_rag.errors import (
    ArgumentTooLongError,
    DuplicateNameError,
    UnionConflictError,
    UnknownModuleError,
    UnknownParamError,
    UnknownSchemaError,
)
from pc_rag.pml.nodes import Import, Module, Param, Prompt, Role, Scaffold, Schema, Union


@dataclass(frozen=True)
class ModuleInfo:
    """Where a module sits in its schema.

    ``parent`` is the enclosing module's name (None at the top level or directly in a role);
    ``union`` is the document-order index (from 0) of the union the module is a member of;
    ``scaffold`` is the name of the scaffold that lists it; ``params`` maps the module's own
    params (not those of nested modules) to their ``len``, in declaration order.
    """

    module: Module
    parent: str | None
    union: int | None
    scaffold: str | None
    params: Mapping[str, int]


def module_index(schema: Schema) -> dict[str, ModuleInfo]:
    """Map every module name of ``schema``, nested ones included, to its :class:`ModuleInfo`.

    The dict is in document order (a module before the modules nested in it).
    """
    index: dict[str, ModuleInfo] = {}
    unions = 0

    def visit(nodes: tuple[object, ...], parent: str | None) -> None:
        nonlocal unions
        for node in nodes:
            if isinstance(node, Module):
                add(node, parent, None, None)
            elif isinstance(node, Union):
                union, unions = unions, unions + 1
                for member in node.members:
                    add(member, parent, union, None)
            elif isinstance(node, Scaffold):
                for member in node.modules:
                    add(member, parent, None, node.name)
            elif isinstance(node, Role):
                visit(node.children, parent)

    def add(node: Module, parent: str | None, union: int | None, scaffold: str | None) -> None:
        params = {child.name: child.length for child in node.children if isinstance(child, Param)}
        index[node.name] = ModuleInfo(node, parent, union, scaffold, params)
        visit(node.children, node.name)

    visit(schema.children, None)
    return index


def iter_imports(prompt: Prompt) -> Iterator[tuple[Import, str | None]]:
    """Yield every import of ``prompt`` (nested ones included) with its parent import's name."""

    def walk(nodes: tuple[object, ...], parent: str | None) -> Iterator[tuple[Import, str | None]]:
        for node in nodes:
            if isinstance(node, Import):
                yield node, parent
                yield from walk(node.children, node.name)
            elif isinstance(node, Role):
                yield from walk(node.children, parent)

    return walk(prompt.children, None)


def validate_prompt(prompt: Prompt, schema: Schema) -> None:
    """Raise a PMLError unless every import of ``prompt`` is allowed by ``schema``.

    A module must be declared and imported at its nesting (inside its parent module's import),
    at most once, with at most one member per union, and only with declared params as
    arguments. Missing arguments are allowed: their params are left empty.
    """
    if prompt.schema != schema.name:
        msg = f"prompt is written for schema {prompt.schema!r}, not {schema.name!r}"
        raise UnknownSchemaError(msg, name=prompt.schema)
    index = module_index(schema)
    seen: set[str] = set()
    chosen: dict[int, str] = {}
    for node, parent in iter_imports(prompt):
        name = node.name
        info = index.get(name)
        if info is None:
            msg = f"schema {schema.name!r} declares no module {name!r}"
            raise UnknownModuleError(msg, name=name)
        if info.parent != parent:
            where = "at the top level" if info.parent is None else f"inside <{info.parent}>"
            msg = f"module {name!r} must be imported {where}"
            raise UnknownModuleError(msg, name=name)
        if name in seen:
            msg = f"module {name!r} is imported twice"
            raise DuplicateNameError(msg, name=name)
        seen.add(name)
        if info.union is not None and chosen.setdefault(info.union, name) != name:
            msg = f"modules {chosen[info.union]!r} and {name!r} are members of the same union"
            raise UnionConflictError(msg, name=name)
        for arg, _ in node.args:
            if arg not in info.params:
                msg = f"module {name!r} declares no param {arg!r}"
                raise UnknownParamError(msg, name=arg)


def check_argument_lengths(prompt: Prompt, schema: Schema, count_tokens: Callable[[str], int]) -> None:
    """Validate ``prompt`` and raise ArgumentTooLongError for an argument longer than its param.

    ``count_tokens`` gives the number of tokens of an argument value, as the model will see it.
    """
    validate_prompt(prompt, schema)
    index = module_index(schema)
    for node, _ in iter_imports(prompt):
        params = index[node.name].params
        for arg, value in node.args:
            tokens = count_tokens(value)
            if tokens > params[arg]:
                msg = f"argument {arg!r} of module {node.name!r} is {tokens} tokens long,"
                msg += f" but its param reserves {params[arg]}"
                raise ArgumentTooLongError(msg, name=arg)
