"""``python -m pc_rag.cli``: the ``pc-rag`` command, where the package is on the path but not installed (a GPU
machine that receives the checkout)."""

import sys

from pc_rag.cli.app import main

sys.exit(main())
