"""Copy the bundled SmolLM2 tokenizer into ``.gpu/tokenizer`` (ignored by git) for ``examples/gpu/acceptance.sh``.

No weights travel to the GPU machine: the benchmark builds random-weight models of real shapes there, and only the
tokenizer is needed (the bundled model's, converted from its GGUF here on first use).
"""

from __future__ import annotations

import shutil
from pathlib import Path

from pc_rag.bench.gpu import default_tokenizer_dir

FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja")


def main() -> None:
    source = default_tokenizer_dir()
    target = Path(__file__).resolve().parents[2] / ".gpu" / "tokenizer"
    target.mkdir(parents=True, exist_ok=True)
    for name in FILES:
        if (source / name).is_file():
            shutil.copy2(source / name, target / name)
    print(f"copied the tokenizer of {source} into {target}")


if __name__ == "__main__":
    main()
