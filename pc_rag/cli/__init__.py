"""The ``pc-rag`` command line: the parser and its dispatch (``app``) and the document-store jobs it runs
(``store_commands``)."""

from pc_rag.huge_pages import ask_for_huge_pages

ask_for_huge_pages()  # before anything imports torch: it reads the variable at its first allocation

from pc_rag.cli.app import COMPUTE_DTYPE_NAMES, main  # noqa: E402

__all__ = ["COMPUTE_DTYPE_NAMES", "main"]
