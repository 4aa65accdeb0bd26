"""``tune`` never replaces the installed adapter: it writes a new file compared with the installed one on held-out
pairs; ``install`` serves it only when it was better, ``restore`` returns to the shipped one; too few usable
questions are refused with the number of chunks that would do."""

from __future__ import annotations

import json

import pytest
import torch
from test_tune_store import store, writer  # noqa: F401 (the store fixture and its question writer)

from pc_rag.errors import PCRagError
from pc_rag.rag.adapter import AdapterConfig, SpliceAdapter
from pc_rag.rag.tuned import PACKAGED, adapter_file, calibration_file, installed_adapter, tuned_dirs
from pc_rag.store._atomic import sha256_file
from pc_rag.tune.install import install, restore
from pc_rag.tune.store_command import tune_store
from pc_rag.tune.train import TrainConfig

CONFIG = TrainConfig(epochs=1, lr=5e-3, accumulate=1, eval_every=2, patience=5)


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("PC_RAG_CACHE", str(tmp_path / "cache"))
    return tmp_path / "cache" / "tuned"


def random_adapter(store, path, seed: int = 0) -> str:  # noqa: F811
    """Save an adapter with nonzero pairs at ``path``; return its sha256."""
    lm = store.engine.lm
    adapter = SpliceAdapter(lm.model, AdapterConfig(rank=2), lm.fingerprint())
    torch.manual_seed(seed)
    adapter.load_state_dict({k: torch.randn_like(v) * 0.05 for k, v in adapter.state_dict().items()})
    adapter.save(path)
    return sha256_file(path)


def test_tune_writes_a_new_file_compared_with_the_installed_adapter(store, cache, tmp_path, monkeypatch) -> None:  # noqa: F811
    monkeypatch.setattr("pc_rag.tune.store_command.MIN_PAIRS", {"train": 1, "val": 1})
    installed = cache / adapter_file(store.engine.lm.fingerprint())
    sha = random_adapter(store, installed)
    summary = tune_store(store, tmp_path / "work", tmp_path / "new.safetensors", pairs=4, k=2, held_out=0.2,
                         adapter_config=AdapterConfig(rank=2), train_config=CONFIG, progress=False)  # fmt: skip
    assert sha256_file(installed) == sha  # untouched
    before = summary["installed"]
    assert before["path"] == str(installed) and before["sha256"] == sha and before["mean_kl"] > 0
    report = json.loads((tmp_path / "new.json").read_text())
    assert report["installed"] == before and report["adapter"] == str(tmp_path / "new.safetensors")


def candidate(store, tmp_path, best: float, installed: dict | None, *, calibrated: bool = False):  # noqa: F811
    """An adapter file with the report ``tune`` writes beside it (best mean KL ``best``, compared with
    ``installed``)."""
    path = tmp_path / "candidate.safetensors"
    random_adapter(store, path, seed=1)
    report = {"fingerprint": store.engine.lm.fingerprint(), "best": {"first_kl": best, "mean_kl": best},
              "installed": installed}  # fmt: skip
    path.with_suffix(".json").write_text(json.dumps(report))
    if calibrated:
        (tmp_path / "candidate.calibration.json").write_text("{}")
    return path


def test_install_serves_a_better_adapter_refuses_a_worse_or_stale_one(store, cache, tmp_path) -> None:  # noqa: F811
    fingerprint = store.engine.lm.fingerprint()
    target = cache / adapter_file(fingerprint)
    with pytest.raises(PCRagError, match="no such adapter file"):
        install(tmp_path / "missing.safetensors")
    path = candidate(store, tmp_path, 0.5, None, calibrated=True)
    path.with_suffix(".json").unlink()
    with pytest.raises(PCRagError, match=r"candidate\.json .*missing or unreadable"):
        install(path)
    path = candidate(store, tmp_path, 0.5, None, calibrated=True)  # compared with no adapter: none installed
    done = install(path)
    assert done.path == target and sha256_file(target) == sha256_file(path) and done.replaced is None
    assert (cache / calibration_file(fingerprint)).read_text() == "{}"
    with pytest.raises(PCRagError, match="was compared with no adapter, but serving now finds"):
        install(path)  # one is installed now: the comparison is stale
    sha = sha256_file(target)
    (tmp_path / "candidate.calibration.json").unlink()
    was = {"path": str(target), "sha256": sha, "first_kl": 0.3, "mean_kl": 0.3}
    with pytest.raises(PCRagError, match=r"no better than the installed .* \(mean KL .* 0\.4000, installed 0\.3000\)"):
        install(candidate(store, tmp_path, 0.4, was))
    assert sha256_file(target) == sha  # refused: unchanged
    done = install(candidate(store, tmp_path, 0.2, was))
    assert done.replaced == target and done.replaced_kl == 0.3 and done.mean_kl == 0.2
    removed, now = restore(fingerprint)
    assert removed == [target, cache / calibration_file(fingerprint)] and now is None
    assert installed_adapter(fingerprint) is None and restore(fingerprint) == ([], None)


def test_restore_returns_to_the_shipped_adapter(cache) -> None:
    shipped = sorted(PACKAGED.glob("*.safetensors"))
    fingerprint = next(p.name.removesuffix(".safetensors") for p in shipped if "." not in p.stem)
    (cache / adapter_file(fingerprint)).parent.mkdir(parents=True)
    (cache / adapter_file(fingerprint)).write_bytes(b"installed")
    assert installed_adapter(fingerprint) == cache / adapter_file(fingerprint)
    assert restore(fingerprint) == ([cache / adapter_file(fingerprint)], PACKAGED / adapter_file(fingerprint))
    assert tuned_dirs()[0] == cache


def test_too_few_usable_questions_are_refused_with_chunks_needed(store, cache, tmp_path, monkeypatch) -> None:  # noqa: F811
    kwargs = {"adapter_config": AdapterConfig(rank=2), "train_config": CONFIG, "progress": False, "k": 2}
    with pytest.raises(PCRagError, match=r"--pairs 4 with --held-out 0\.2 asks for 3 training and 1 held-out .*"
                                         r"at least 16 and 4: give --pairs 20 or more"):  # fmt: skip
        tune_store(store, tmp_path / "w1", tmp_path / "a.safetensors", pairs=4, held_out=0.2, **kwargs)
    calls = []

    def every_other(engine, passage):  # half the written questions are usable
        calls.append(passage)
        return "Why?" if len(calls) % 2 else f"What does the passage say about {max(passage.split(), key=len)}?"

    monkeypatch.setattr("pc_rag.tune.store_pairs.write_question", every_other)
    with pytest.raises(PCRagError) as refused:
        tune_store(store, tmp_path / "w2", tmp_path / "a.safetensors", pairs=40, held_out=0.2, **kwargs)
    message = str(refused.value)
    assert "fewer than the 16 and 4 tune --store needs" in message, message
    assert "(50%); at that rate it needs about 32 chunks in training documents and 8 in held-out ones" in message
    assert not (tmp_path / "a.safetensors").exists()


def test_too_few_chunks_are_refused_before_any_question(store, cache, tmp_path, monkeypatch) -> None:  # noqa: F811
    monkeypatch.setattr("pc_rag.tune.store_command.MIN_PAIRS", {"train": 1, "val": 1000})
    written = []
    monkeypatch.setattr("pc_rag.tune.store_pairs.write_question", lambda engine, text: written.append(text) or "x")
    with pytest.raises(PCRagError, match=r"chunks in training documents and \d+ in held-out ones; .* at least 1 and "
                                         r"1000 usable ones"):  # fmt: skip
        tune_store(store, tmp_path / "w", tmp_path / "a.safetensors", pairs=2000, held_out=0.5, k=2,
                   adapter_config=AdapterConfig(rank=2), train_config=CONFIG, progress=False)  # fmt: skip
    assert written == []
