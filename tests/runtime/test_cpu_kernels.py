"""The CPU decode-attention kernel against a float64 reference, and the property speculation rests on: a row's
bits depend on its own query and the slots it sees, never on the other rows of the call or the thread count."""

from __future__ import annotations

import pytest
import torch

from pc_rag.runtime import cpu_kernels

KERNEL = cpu_kernels.decode_attention()
pytestmark = pytest.mark.skipif(KERNEL is None, reason="the CPU decode-attention kernel does not run here")


def reference(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, ends: list[int], scale: float) -> torch.Tensor:
    rows = []
    for r, end in enumerate(ends):
        scores = torch.einsum("hgd,hsd->hgs", q[r].double(), keys[:, :end].double()) * scale
        rows.append(torch.einsum("hgs,hsd->hgd", torch.softmax(scores, -1), values[:, :end].double()))
    return torch.stack(rows)


def cache(kv_heads: int, capacity: int, dim: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """Keys and values as the step hands them: [H_kv, capacity, D] views of a [1, H_kv, capacity, D] buffer."""
    return torch.randn(1, kv_heads, capacity, dim).to(dtype)[0], torch.randn(1, kv_heads, capacity, dim).to(dtype)[0]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize(
    ("kv_heads", "groups", "dim", "length"),
    [(3, 3, 64, 1030), (1, 4, 64, 257), (2, 5, 32, 256), (4, 1, 128, 7), (2, 2, 40, 1), (3, 3, 64, 8006)],
)
def test_the_kernel_equals_attention_in_float64(
    dtype: torch.dtype, kv_heads: int, groups: int, dim: int, length: int
) -> None:
    torch.manual_seed(length)
    keys, values = cache(kv_heads, length + 37, dim, dtype)  # slots past every row's end are never read
    keys[:, length:], values[:, length:] = float("nan"), float("nan")
    q = torch.randn(4, kv_heads, groups, dim)
    ends = [max(1, length - 3), max(1, length - 2), max(1, length - 1), length]
    out = KERNEL(q, keys, values, torch.tensor(ends), dim**-0.5)  # type: ignore[misc]
    assert out.shape == q.shape and out.dtype == torch.float32
    torch.testing.assert_close(out.double(), reference(q, keys.float(), values.float(), ends, dim**-0.5),
                               atol=2e-6, rtol=1e-5)  # fmt: skip


def test_a_row_gets_the_same_bits_alone_beside_others_and_at_any_thread_count() -> None:
    torch.manual_seed(0)
    keys, values = cache(3, 2100, 64, torch.bfloat16)
    q = torch.randn(4, 3, 3, 64)
    ends = torch.tensor([2000, 2001, 2002, 2003])
    together = KERNEL(q, keys, values, ends, 0.125)  # type: ignore[misc]
    threads = torch.get_num_threads()
    try:
        for count in (1, 2):
            torch.set_num_threads(count)
            for r in range(4):
                alone = KERNEL(q[r : r + 1].contiguous(), keys, values, ends[r : r + 1], 0.125)  # type: ignore[misc]
                assert torch.equal(alone, together[r : r + 1])
    finally:
        torch.set_num_threads(threads)


def test_bad_input_is_refused_with_what_was_wrong() -> None:
    keys, values = cache(3, 16, 64, torch.bfloat16)
    q = torch.randn(1, 3, 3, 64)
    with pytest.raises(RuntimeError, match="row 0 sees 17 keys, not 1 to 16"):
        KERNEL(q, keys, values, torch.tensor([17]), 0.125)  # type: ignore[misc]
    with pytest.raises(RuntimeError, match="contiguous float32"):
        KERNEL(q.bfloat16(), keys, values, torch.tensor([4]), 0.125)  # type: ignore[misc]
    with pytest.raises(RuntimeError, match="disagree on heads or dim"):
        KERNEL(torch.randn(1, 2, 3, 64), keys, values, torch.tensor([4]), 0.125)  # type: ignore[misc]


def test_switched_off_the_step_has_no_kernel(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(cpu_kernels.SWITCH, "0")
    monkeypatch.setattr(cpu_kernels, "_LOADED", [])
    assert cpu_kernels.decode_attention() is None


def test_steps_use_it_over_bfloat16_caches_only() -> None:
    """Over float32 the flash kernel is as fast (decode_kernels_floor.py), so float32 models keep it."""
    assert cpu_kernels.decode_attention_over(torch.zeros(1, 3, 8, 64, dtype=torch.bfloat16)) is KERNEL
    assert cpu_kernels.decode_attention_over(torch.zeros(1, 3, 8, 64)) is None


def test_without_a_compiler_decoding_keeps_the_flash_path(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CXX", "/nonexistent/c++")
    monkeypatch.setattr(cpu_kernels, "_LOADED", [])
    assert "no C++ compiler" in str(cpu_kernels._supported())
    assert cpu_kernels.decode_attention() is None


def test_a_finished_build_loads_directly_and_an_unfinished_one_does_not(tmp_path) -> None:
    _, directory = cpu_kernels._build_directory()
    module = cpu_kernels._load_built(directory)  # what the next process loads, without cpp_extension
    assert module is not None
    q, (keys, values) = torch.randn(1, 3, 3, 64), cache(3, 16, 64, torch.bfloat16)
    assert torch.equal(module.decode_attention(q, keys, values, torch.tensor([9]), 0.125),
                       KERNEL(q, keys, values, torch.tensor([9]), 0.125))  # type: ignore[misc]  # fmt: skip
    (tmp_path / "pc_rag_decode_attention_x.so").write_bytes(b"half a build")  # no ready marker: not loaded
    assert cpu_kernels._load_built(tmp_path) is None
