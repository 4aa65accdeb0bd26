"""The ``pc-rag`` command line: the parser and its dispatch (``app``) and the document-store jobs it runs
(``store_commands``)."""

from pc_rag.cli.app import COMPUTE_DTYPE_NAMES, main

__all__ = ["COMPUTE_DTYPE_NAMES", "main"]
