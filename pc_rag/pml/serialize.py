"""Write schemas and prompts back to PML (XML) text.

For a tree produced by the parser, the builder or a prompt program, parsing the output gives
the same tree back. Text is escaped (``&``, ``<``, ``>`` and CR, which XML would otherwise
normalize); newlines are added only between top-level elements, where the whitespace rule of
the parser drops them. The serializer does not check the tree: see :mod:`pc_rag.pml.rules`.
"""

from __future__ import annotations

from pc_rag.pml.nodes import Import, Module, Param, Prompt, Role, Scaffold, Schema, Text, Union

_TEXT_ESCAPES = str.maketrans({"&": "&amp;", "<": "&lt;", ">": "&gt;", "\r": "&#13;"})
_ATTR_ESCAPES = str.maketrans(
    {
        "&": "&amp;",
        "<": "&lt;",
        ">": "&gt;",
        '"': "&quot;",
        "\t": "&#9;",
        "\n": "&#10;",
        "\r": "&#13;",
    }
)


def to_xml(node: Schema | Prompt) -> str:
    """Serialize a schema or a prompt to a PML document."""
    if isinstance(node, Schema):
        return _element("schema", [("name", node.name)], node.children, top=True)
    return _element("prompt", [("schema", node.schema)], node.children, top=True)


def _element(tag: str, attrs: list[tuple[str, str]], children: tuple[object, ...], top: bool = False) -> str:
    start = tag + "".join(f' {key}="{value.translate(_ATTR_ESCAPES)}"' for key, value in attrs)
    if not children:
        return f"<{start}/>"
    parts = [f"<{start}>"]
    previous: object = None
    for child in children:
        if top and _is_block(child) and (previous is None or _is_block(previous)):
            parts.append("\n  ")
        parts.append(_node(child))
        previous = child
    if top and _is_block(previous):
        parts.append("\n")
    parts.append(f"</{tag}>")
    return "".join(parts)


def _is_block(node: object) -> bool:
    return not isinstance(node, (Text, Param))


def _node(node: object) -> str:
    if isinstance(node, Text):
        return node.text.translate(_TEXT_ESCAPES)
    if isinstance(node, Param):
        return _element("param", [("name", node.name), ("len", str(node.length))], ())
    if isinstance(node, Module):
        return _element("module", [("name", node.name)], node.children)
    if isinstance(node, Union):
        return _element("union", [], node.members)
    if isinstance(node, Scaffold):
        return _element("scaffold", [("name", node.name)], node.modules)
    if isinstance(node, Role):
        return _element(node.role, [], node.children)
    if isinstance(node, Import):
        return _element(node.name, list(node.args), node.children)
    msg = f"cannot serialize {type(node).__name__} as PML"
    raise TypeError(msg)
