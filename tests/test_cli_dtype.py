"""The CLI's compute dtype when none is given: the measured serving default, float32 for measurements."""

from __future__ import annotations

import argparse

import pytest

from pc_rag.cli.app import MEASURED_DTYPES, SERVING_COMMANDS, default_dtype
from pc_rag.model import DEFAULT_MODEL


def _args(command: str, model: str | None = None, device: str = "cpu") -> argparse.Namespace:
    return argparse.Namespace(command=command, model=model, device=device)


@pytest.mark.parametrize("command", SERVING_COMMANDS)
def test_serving_commands_take_the_measured_dtype_of_the_bundled_model_on_the_cpu(command: str) -> None:
    assert default_dtype(_args(command)) == "int4"
    assert default_dtype(_args(command, DEFAULT_MODEL)) == "int4"
    assert default_dtype(_args(command, "some/local-model")) == "float32"  # not measured: the reference dtype
    assert default_dtype(_args(command, device="cuda")) == "float32"  # int4 has no GPU kernel


@pytest.mark.parametrize("command", ["bench", "eval", "tune", "tune-codec", "store"])
def test_measurement_commands_keep_float32(command: str) -> None:
    assert default_dtype(_args(command)) == "float32"


def test_the_measured_dtypes_name_the_bundled_model() -> None:
    assert set(MEASURED_DTYPES) == {DEFAULT_MODEL}
