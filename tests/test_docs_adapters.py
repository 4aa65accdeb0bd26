"""The docs say which bundled models have a shipped splice adapter, and ``pc_rag/data/tuned/`` agrees: every
sentence of README.md, docs/ and pc_rag/data/README.md that calls a bundled model's adapter shipped (or not
shipped) matches the files there."""

from __future__ import annotations

import json
import re
from pathlib import Path

from pc_rag.model import DEFAULT_MODEL
from pc_rag.rag.tuned import PACKAGED

ROOT = Path(__file__).resolve().parent.parent
DOCS = [ROOT / "README.md", ROOT / "pc_rag" / "data" / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
NAMES = {"smollm2-135m-instruct": ("SmolLM2", "smollm2"), "gemma3-270m": ("Gemma 3 270M", "gemma3-270m", "Gemma")}


def shipped_models() -> set[str]:
    """The bundled models with an adapter in the package: each report's training command names its ``--model``
    (none: the default model)."""
    models = set()
    for adapter in PACKAGED.glob("*.safetensors"):
        if "." in adapter.stem:
            continue  # CacheGen tables, not an adapter
        report = json.loads(adapter.with_suffix(".json").read_text(encoding="utf-8"))
        found = re.search(r"--model (\S+)", report.get("command", ""))
        models.add(found.group(1) if found else DEFAULT_MODEL)
    return models


def claims() -> list[tuple[Path, str, str, bool]]:
    """(file, sentence, model, says shipped) for every sentence about a named model's adapter being shipped."""
    found = []
    for path in DOCS:
        text = re.sub(r"\s+", " ", path.read_text(encoding="utf-8"))
        for sentence in re.split(r"(?<=[.;])\s+|\|", text):
            if "shipped" not in sentence or "adapter" not in sentence:
                continue
            for model, names in NAMES.items():
                if any(n in sentence for n in names):
                    found.append((path, sentence, model, "not shipped" not in sentence))
    return found


def test_the_shipped_adapters_are_those_of_both_bundled_models() -> None:
    assert shipped_models() == set(NAMES)


def test_every_shipped_or_not_shipped_claim_matches_the_package() -> None:
    shipped, found = shipped_models(), claims()
    assert any(model == "gemma3-270m" for _, _, model, _ in found)  # the README's Gemma line is among them
    wrong = [(p.name, s) for p, s, model, says in found if says != (model in shipped)]
    assert not wrong, wrong
