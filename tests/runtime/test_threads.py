"""``--threads auto``: torch's threads follow the cores other processes leave free."""

from __future__ import annotations

import subprocess
import sys
import time

import pytest
import torch

from pc_rag.cli import main
from pc_rag.runtime.threads import FreeCores


@pytest.fixture
def restore_threads():
    before = torch.get_num_threads()
    yield
    torch.set_num_threads(before)


def test_threads_are_the_cores_others_leave_free(monkeypatch, restore_threads) -> None:
    samples = iter([(0.0, 0.0, 0.0), (1.0, 1.0, 0.05), (2.0, 1.2, 0.25), (2.01, 1.3, 0.3)])
    monkeypatch.setattr(FreeCores, "_sample", staticmethod(lambda: next(samples)))
    policy = FreeCores(cores=2)
    assert policy.adapt() == 1  # another process kept about one core busy for a second
    assert policy.adapt() == 2  # then the machine was ours alone
    assert policy.adapt() == 2  # 10 ms later: too soon to tell, the choice stands


def test_a_busy_process_beside_us_is_seen(restore_threads) -> None:
    policy = FreeCores(cores=2)
    loop = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    try:
        time.sleep(1.0)
        others = policy.others_busy()
    finally:
        loop.kill()
        loop.wait()
    assert others is not None and others > 0.5


@pytest.mark.parametrize("value", ["0", "-2", "many"])
def test_bad_thread_counts_are_refused(value: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_:
        main(["--threads", value, "demo"])
    assert exit_.value.code == 2
    assert "--threads" in capsys.readouterr().err
