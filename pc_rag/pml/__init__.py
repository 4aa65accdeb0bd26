"""PML, the Prompt Markup Language: schemas of cacheable modules, and prompts that import them.

Write PML as XML (:func:`parse_schema`, :func:`parse_prompt`, :func:`to_xml`), with the Python
builders (:class:`SchemaBuilder`, :class:`PromptBuilder`), or as a prompt program
(:func:`prompt_program`); all produce the same immutable nodes. This package knows nothing about
tokens or models.
"""

from pc_rag.pml.builder import (
    PromptBuilder,
    SchemaBuilder,
    assistant,
    module,
    param,
    role,
    scaffold,
    system,
    text,
    union,
    use,
    user,
)
from pc_rag.pml.nodes import ROLES, Import, Module, Param, Prompt, Role, RoleName, Scaffold, Schema, Text, Union
from pc_rag.pml.parser import MAX_DEPTH, MAX_SOURCE_BYTES, parse_prompt, parse_schema
from pc_rag.pml.program import MaxLen, PromptProgram, prompt_program
from pc_rag.pml.rules import MAX_PARAM_LENGTH, RESERVED_NAMES, check_prompt, check_schema
from pc_rag.pml.serialize import to_xml
from pc_rag.pml.validate import ModuleInfo, check_argument_lengths, iter_imports, module_index, validate_prompt

__all__ = [
    "MAX_DEPTH",
    "MAX_PARAM_LENGTH",
    "MAX_SOURCE_BYTES",
    "RESERVED_NAMES",
    "ROLES",
    "Import",
    "MaxLen",
    "Module",
    "ModuleInfo",
    "Param",
    "Prompt",
    "PromptBuilder",
    "PromptProgram",
    "Role",
    "RoleName",
    "Scaffold",
    "Schema",
    "SchemaBuilder",
    "Text",
    "Union",
    "assistant",
    "check_argument_lengths",
    "check_prompt",
    "check_schema",
    "iter_imports",
    "module",
    "module_index",
    "param",
    "parse_prompt",
    "parse_schema",
    "prompt_program",
    "role",
    "scaffold",
    "system",
    "text",
    "to_xml",
    "union",
    "use",
    "user",
    "validate_prompt",
]
