"""Turn a Python prompt *program* into a PML schema by reading its source; it is never run.

Conventions for the body of a function decorated with :func:`prompt_program`:

- ``text(...)`` adds text: string literals, f-strings and parameter names (placeholders are bare names).
- ``system(...)``, ``user(...)``, ``assistant(...)`` add a chat turn of text (top level only).
- ``if flag:`` (no ``else``) makes module ``flag``, imported when argument ``flag`` is truthy.
- ``if x == "a": ... elif x == "b": ...`` or ``match x: case "a": ... case "b": ...`` makes a union of
  modules ``a`` and ``b``; the one equal to argument ``x`` is imported.
- ``other()``, for another prompt program ``other``, makes module ``other`` of its body, always imported;
  ``other``'s parameters become arguments of the caller's ``.prompt()``.
- In a module, a parameter annotated ``Annotated[str, MaxLen(n)]`` is a ``<param len=n>``; a plain ``str``
  one is an error. Outside modules, text using a parameter is uncached: ``.prompt()`` renders it.
- The docstring and ``pass`` are ignored; anything else (bare strings, loops, assignments, ``else``,
  other calls) raises PMLStructureError with the offending source line.

The program knows nothing about tokens or models; it only produces nodes.
"""

from __future__ import annotations

import ast
import inspect
import textwrap
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple

from pc_rag.errors import PMLError, PMLStructureError, UnknownModuleError, UnknownParamError
from pc_rag.pml.nodes import ROLES, Import, Module, Param, Prompt, Role, Schema, Text, Union
from pc_rag.pml.rules import check_schema, tidy
from pc_rag.pml.validate import module_index


@dataclass(frozen=True)
class MaxLen:
    """``Annotated[str, MaxLen(n)]`` bounds a prompt-program argument to ``n`` tokens."""

    tokens: int


class _Slot(NamedTuple):
    """Module ``name``: imported always (no ``var``), if ``var`` is truthy, or if it equals ``value``."""

    name: str
    var: str | None
    value: str | None
    children: tuple[_Slot, ...]


class _Uncached(NamedTuple):
    """Text, or a turn when ``role`` is set, rendered from the arguments at prompt time."""

    role: str | None
    parts: tuple[str | ast.Name, ...]


class PromptProgram:
    """A decorated prompt program: ``.schema`` is its schema, ``.prompt(**args)`` a prompt."""

    def __init__(self, fn: Callable[..., Any]) -> None:
        self.name = fn.__name__
        try:
            func = ast.parse(textwrap.dedent(inspect.getsource(fn))).body[0]
        except (OSError, TypeError, SyntaxError) as e:
            msg = f"the source of prompt program {self.name!r} is not available"
            raise PMLError(msg, name=self.name) from e
        if not isinstance(func, ast.FunctionDef):
            msg = f"prompt program {self.name!r} must be a function defined with def"
            raise PMLStructureError(msg, name=self.name)
        self.func = func
        self.offset = fn.__code__.co_firstlineno - 1
        closure = inspect.getclosurevars(fn)
        self.scope = {**closure.globals, **closure.nonlocals}
        args = [*self.func.args.posonlyargs, *self.func.args.args, *self.func.args.kwonlyargs]
        self.params = {arg.arg for arg in args}
        self.texts = _text_params(args, self.offset)
        analyzer = _Analyzer()
        children, self._items = analyzer.program(self, in_module=False)
        self.schema = Schema(self.name, tidy(children))
        check_schema(
            analyzer.keep(self.schema, self.func.lineno + self.offset), lambda node: analyzer.lines.get(id(node))
        )
        self._names, self._choices = analyzer.names, analyzer.choices
        self._index = module_index(self.schema)

    def prompt(self, **arguments: object) -> Prompt:
        """The prompt a call with ``arguments`` selects; params of missing ones are left empty."""
        for name, value in arguments.items():
            if name not in self._names:
                msg = f"prompt program {self.name!r} has no parameter {name!r}"
                raise UnknownParamError(msg, name=name)
            if name in self._choices and value is not None and value not in self._choices[name]:
                msg = f"{name}={value!r} selects no module; expected one of {self._choices[name]}"
                raise UnknownModuleError(msg, name=str(value))
        return Prompt(self.name, tidy(self._render(self._items, arguments)))

    def _render(self, items: Sequence[_Slot | _Uncached], arguments: dict[str, object]) -> list:
        out: list = []
        for item in items:
            if isinstance(item, _Uncached):
                text = "".join(p if isinstance(p, str) else _arg(arguments, p.id) for p in item.parts)
                out.append(Text(text) if item.role is None else Role(item.role, tidy([text])))
            elif _selected(item, arguments):
                params = self._index[item.name].params
                args = tuple((name, _arg(arguments, name)) for name in params if name in arguments)
                out.append(Import(item.name, args, tuple(self._render(item.children, arguments))))
        return out


def prompt_program(fn: Callable[..., Any]) -> PromptProgram:
    """Decorator: analyse ``fn``'s source (without running it) into a :class:`PromptProgram`."""
    return PromptProgram(fn)


def _selected(slot: _Slot, arguments: dict[str, object]) -> bool:
    if slot.var is None:
        return True
    value = arguments.get(slot.var)
    return bool(value) if slot.value is None else value == slot.value


def _arg(arguments: dict[str, object], name: str) -> str:
    value = arguments.get(name, "")
    if not isinstance(value, str):
        msg = f"argument {name!r} must be a str, not {type(value).__name__}"
        raise PMLError(msg, name=name)
    return value


def _named(node: ast.expr | None, name: str) -> bool:
    return node.attr == name if isinstance(node, ast.Attribute) else isinstance(node, ast.Name) and node.id == name


def _text_params(args: list[ast.arg], offset: int) -> dict[str, int | None]:
    """Map each ``str`` parameter to its ``MaxLen`` (None when unbounded)."""
    texts: dict[str, int | None] = {}
    for arg in args:
        annotation, meta = arg.annotation, []
        if isinstance(annotation, ast.Subscript) and _named(annotation.value, "Annotated"):
            annotation, *meta = getattr(annotation.slice, "elts", [None])
        if not _named(annotation, "str"):
            continue
        texts[arg.arg] = None
        for call in meta:
            if isinstance(call, ast.Call) and _named(call.func, "MaxLen"):
                values = [*call.args, *(keyword.value for keyword in call.keywords)]
                value = values[0] if len(values) == 1 else None
                if not isinstance(value, ast.Constant) or type(value.value) is not int:
                    msg = "MaxLen takes one integer literal"
                    raise PMLStructureError(msg, name=arg.arg, line=arg.lineno + offset)
                texts[arg.arg] = value.value
    return texts


def _is_literal(node: ast.expr | None) -> bool:
    return isinstance(node, ast.JoinedStr) or (isinstance(node, ast.Constant) and isinstance(node.value, str))


def _error(message: str, node: Any, program: PromptProgram) -> PMLStructureError:
    snippet = ast.unparse(node).splitlines()[0]
    return PMLStructureError(f"{message}: {snippet}", line=node.lineno + program.offset)


def _branches(program: PromptProgram, stmt: ast.If | ast.Match) -> list[tuple[Any, ...]]:
    """``(subject, compared value, body, node)`` per branch; None where not a comparison."""
    if isinstance(stmt, ast.Match):
        return [
            (stmt.subject, None if c.guard else getattr(c.pattern, "value", None), c.body, c.pattern)
            for c in stmt.cases
        ]
    branches, branch = [], stmt
    while True:
        test = branch.test
        if isinstance(test, ast.Compare) and [type(op) for op in test.ops] == [ast.Eq]:
            branches.append((test.left, test.comparators[0], branch.body, branch))
        else:
            branches.append((None, None, branch.body, branch))
        if not branch.orelse:
            return branches
        if len(branch.orelse) != 1 or not isinstance(branch.orelse[0], ast.If):
            msg = "else cannot name a union member; use elif with a compared value"
            raise _error(msg, branch.orelse[0], program)
        branch = branch.orelse[0]


class _Analyzer:
    """Walks program bodies into schema nodes, and the items that ``.prompt()`` renders."""

    def __init__(self) -> None:
        self.lines: dict[int, int] = {}
        self.names: set[str] = set()
        self.choices: dict[str, list[str]] = {}

    def keep(self, node: Any, line: int) -> Any:
        self.lines[id(node)] = line
        return node

    def program(self, program: PromptProgram, in_module: bool) -> tuple[list, list]:
        """A program's nodes and items; programs only include earlier ones, so this terminates."""
        self.names |= program.params
        body = program.func.body[1:] if ast.get_docstring(program.func) is not None else program.func.body
        return self.block(program, body, in_module)

    def block(self, program: PromptProgram, body: list[ast.stmt], in_module: bool) -> tuple:
        done = [self.statement(program, stmt, in_module) for stmt in body]
        return [n for nodes, _ in done for n in nodes], [i for _, items in done for i in items]

    def statement(self, program: PromptProgram, stmt: ast.stmt, in_module: bool) -> tuple:
        line = stmt.lineno + program.offset
        call = stmt.value if isinstance(stmt, ast.Expr) else None
        if isinstance(stmt, ast.If) and isinstance(stmt.test, ast.Name) and not stmt.orelse:
            name = self.variable(program, stmt.test, stmt)
            return self.modules(program, name, [(name, None, stmt.body, line)])
        if isinstance(stmt, (ast.If, ast.Match)):
            var, cases = self.cases(program, stmt)
            self.choices.setdefault(var, []).extend(value for _, value, _, _ in cases)
            members, items = self.modules(program, var, cases)
            return [self.keep(Union(tuple(members)), line)], items
        if isinstance(call, ast.Call) and isinstance(call.func, ast.Name):
            return self.call(program, call, call.func.id, in_module, line)
        if isinstance(stmt, ast.Pass):
            return [], []
        hint = "; wrap text in text(...)" if _is_literal(call) else ""
        raise _error(f"unsupported statement in a prompt program{hint}", stmt, program)

    def variable(self, program: PromptProgram, node: ast.expr | None, stmt: ast.AST) -> str:
        if not isinstance(node, ast.Name) or node.id not in program.params:
            raise _error(f"the condition must test a parameter of {program.name!r}", stmt, program)
        return node.id

    def cases(self, program: PromptProgram, stmt: ast.If | ast.Match) -> tuple[str, list]:
        """The compared parameter, and ``(name, value, body, line)`` per member of the union."""
        branches = _branches(program, stmt)
        var = self.variable(program, branches[0][0], stmt)
        cases = []
        for subject, value, body, node in branches:
            same = isinstance(subject, ast.Name) and subject.id == var
            if not (same and isinstance(value, ast.Constant) and isinstance(value.value, str)):
                msg = "each branch must compare the same parameter to a string literal"
                raise _error(msg, node, program)
            cases.append((value.value, value.value, body, node.lineno + program.offset))
        return var, cases

    def modules(self, program: PromptProgram, var: str | None, cases: list) -> tuple[list, list]:
        """One module per ``(name, value, body, line)``, and the slot that selects it."""
        members, items = [], []
        for name, value, body, line in cases:
            children, slots = self.block(program, body, in_module=True)
            members.append(self.keep(Module(name, tidy(children)), line))
            items.append(_Slot(name, var, value, tuple(slots)))
        return members, items

    def call(self, program: PromptProgram, call: ast.Call, name: str, in_module: bool, line: int) -> tuple:
        if name != "text" and name not in ROLES:
            other = program.scope.get(name)
            if not isinstance(other, PromptProgram) or call.args or call.keywords:
                msg = "only text(), roles and other prompt programs (without arguments) are called"
                raise _error(msg, call, program)
            children, slots = self.program(other, in_module=True)
            module = self.keep(Module(other.name, tidy(children)), line)
            return [module], [_Slot(other.name, None, None, tuple(slots))]
        if call.keywords or (name != "text" and in_module):
            raise _error(f"{name}() takes text arguments, at the top level only", call, program)
        parts = [part for arg in call.args for part in self.parts(program, arg)]
        role = None if name == "text" else name
        if in_module:
            return [self.keep(self.inline(program, part, call), line) for part in parts], []
        if any(isinstance(part, ast.Name) for part in parts):
            return [], [_Uncached(role, tuple(parts))]
        text = "".join(parts)
        return [self.keep(Text(text) if role is None else Role(role, tidy([text])), line)], []

    def parts(self, program: PromptProgram, arg: ast.expr) -> list[str | ast.Name]:
        """String literals, and the names of ``str`` parameters."""
        parts: list[str | ast.Name] = []
        for value in arg.values if isinstance(arg, ast.JoinedStr) else [arg]:
            if isinstance(value, ast.FormattedValue) and value.conversion == -1:
                value = value.value if value.format_spec is None else value
            if isinstance(value, ast.Constant) and isinstance(value.value, str):
                parts.append(value.value)
            elif isinstance(value, ast.Name) and value.id in program.texts:
                parts.append(value)
            else:
                raise _error("text is made of string literals and str parameters", arg, program)
        return parts

    def inline(self, program: PromptProgram, part: str | ast.Name, call: ast.Call) -> Text | Param:
        if isinstance(part, str):
            return Text(part)
        length = program.texts[part.id]
        if length is None:
            msg = f"str parameter {part.id!r} needs Annotated[str, MaxLen(n)] to be used in a module"
            raise _error(msg, call, program)
        return Param(part.id, length)
