"""The CPU kernels (``csrc/``), compiled once per machine on first use: decode attention and the step's layers.

PyTorch's flash kernel reads a bfloat16 cache at ~6 GB/s on an AVX2 CPU (it widens in software) and attends a
verify step's rows one batch entry each (``verify_attention``): at 8K tokens a decode step spent 32 of its 58 ms
there (``examples/decode_kernels_floor.py``). The kernel reads each (KV head, chunk of 256 slots) once for every
row and query head that sees it, widens bfloat16 in registers and merges the chunks by log-sum-exp in order. A
row's bits depend on its own query and the slots it sees only, so a fed token and the same token verified
beside drafts get the same bits without padding the cache to buckets. Steps use it over bfloat16 caches (the
quantized and bfloat16 dtypes); over float32 the flash kernel is as fast (``decode_attention_over``).
``decode_layers()`` runs a step's decoder layers in one C++ call with the Python loop's bits
(``csrc/decode_layers.cpp``, used by ``native_layers``); ``low_rank_term()`` is a merged adapter's term per row;
``dot_linear()`` multiplies a few rows by int4/int8 weights on AVX-512 BF16 dot products where the CPU has them
(``csrc/dot_linear.cpp``, used by ``weights`` by default), ``amx_linear()`` on AMX tiles where asked
(``csrc/amx_linear.cpp``).

It is built with ``torch.utils.cpp_extension`` (a C++ compiler and ninja; ~30 s the first time, then loaded in
milliseconds from ``$PC_RAG_KERNEL_CACHE``, by default ``~/.cache/pc_rag/kernels``, one directory per source,
flags and torch installation) for CPUs with AVX2 and FMA; the attention kernel runs 16-lane vectors where the CPU
has AVX-512 (and ``ATEN_CPU_CAPABILITY`` does not ask for less). Elsewhere, when the
build fails, or with ``PC_RAG_CPU_KERNELS=0``, ``decode_attention()`` is None and the step uses the flash path.
"""

from __future__ import annotations

import functools
import hashlib
import importlib.util
import logging
import os
import shutil
import threading
from collections.abc import Callable
from pathlib import Path
from types import ModuleType
from typing import Protocol

import torch

logger = logging.getLogger(__name__)

CSRC = Path(__file__).resolve().parent / "csrc"
SOURCES = sorted(CSRC.glob("*.cpp"))
HEADERS = sorted(CSRC.glob("*.h"))
SWITCH = "PC_RAG_CPU_KERNELS"
CACHE = "PC_RAG_KERNEL_CACHE"


class DecodeAttention(Protocol):
    def __call__(
        self, q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, ends: torch.Tensor, scale: float
    ) -> torch.Tensor:
        """``q`` [R, H_kv, G, D] float32, ``keys``/``values`` [H_kv, S, D] (bfloat16 or float32, slots may be
        strided), ``ends`` int64 [R]: row r attends to slots ``0..ends[r]-1``. Returns [R, H_kv, G, D] float32."""
        ...


_LOCK = threading.Lock()
_LOADED: list[ModuleType | None] = []


def _supported() -> str | None:
    """Why the kernel cannot run here, or None."""
    if os.environ.get(SWITCH, "1") == "0":
        return f"{SWITCH}=0"
    capability = torch.backends.cpu.get_cpu_capability()
    if not capability.startswith(("AVX2", "AVX512")):
        return f"the CPU's vector capability is {capability}, the kernel needs AVX2 and FMA"
    if shutil.which(os.environ.get("CXX", "c++")) is None:
        return "no C++ compiler (c++ or $CXX) on PATH"
    return None


FLAGS = ["-O3", "-mavx2", "-mfma", "-fopenmp"]  # OpenMP: at::parallel_for on torch's own thread pool
READY = "ready"
"""Written (by rename) after a build succeeded: its content is the built module's file name."""


def _build_directory() -> tuple[str, Path]:
    """The module's name and directory: keyed by the source, the flags and the torch installation (two
    environments sharing a home directory would otherwise rebuild each other's)."""
    key = b"".join(path.read_bytes() for path in (*SOURCES, *HEADERS))
    key += " ".join(FLAGS).encode() + torch.__version__.encode() + torch.__file__.encode()
    tag = hashlib.sha256(key).hexdigest()[:16]
    root = Path(os.environ.get(CACHE) or Path.home() / ".cache" / "pc_rag" / "kernels")
    return f"pc_rag_cpu_kernels_{tag}", root / tag


def _load_built(directory: Path) -> ModuleType | None:
    """The module a finished build left in ``directory`` (milliseconds; ``cpp_extension.load`` takes ~2.5 s to
    find it up to date), or None."""
    ready = directory / READY
    if not ready.is_file():
        return None
    path = directory / ready.read_text().strip()
    spec = importlib.util.spec_from_file_location(path.name.split(".")[0], path)
    if spec is None or spec.loader is None or not path.is_file():
        return None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _build() -> ModuleType | None:
    reason = _supported()
    if reason is not None:
        logger.info("CPU decode-attention kernel off: %s; decoding uses PyTorch's flash kernel", reason)
        return None
    name, directory = _build_directory()
    try:
        built = _load_built(directory)
        if built is not None:
            return built
        from torch.utils import cpp_extension

        directory.mkdir(parents=True, exist_ok=True)
        logger.info("building the CPU kernels once into %s (~1 min)", directory)
        module = cpp_extension.load(
            name=name, sources=[str(path) for path in SOURCES], extra_cflags=FLAGS, extra_ldflags=["-fopenmp"],
            build_directory=str(directory), verbose=False,
        )  # fmt: skip
        marker = directory / f"{READY}.{os.getpid()}"
        marker.write_text(Path(module.__file__ or "").name)
        marker.replace(directory / READY)
        return module
    except (RuntimeError, OSError, ImportError, SystemExit) as error:  # no ninja, a compiler error, a bad cache
        logger.warning("CPU decode-attention kernel not built (%s); decoding uses PyTorch's flash kernel", error)
        return None


def decode_attention_over(keys: torch.Tensor) -> DecodeAttention | None:
    """The kernel for a step over the cache ``keys``: a bfloat16 cache on the CPU. Over a float32 cache PyTorch's
    flash kernel is as fast or faster (``examples/decode_kernels_floor.py``: 158 against 231 us at 1K, 1,202
    against 1,325 at 8K on the Zen 3 VM), so float32 models keep it."""
    if keys.device.type != "cpu" or keys.dtype != torch.bfloat16:
        return None
    return decode_attention()


def _module() -> ModuleType | None:
    """The built module, built or loaded on first call (once per process); None where it cannot run."""
    if not _LOADED:  # every decode step asks: the lock only until the first build or load
        with _LOCK:
            if not _LOADED:
                _LOADED.append(_build())
    return _LOADED[0]


def decode_attention() -> DecodeAttention | None:
    """The attention kernel; None where it cannot run (see module)."""
    module = _module()
    return None if module is None else module.decode_attention  # type: ignore[no-any-return]


def low_rank_term() -> Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor] | None:
    """``csrc/low_rank.cpp``'s ``low_rank_term(out, x, a, b)``; None where the kernels cannot run."""
    module = _module()
    return None if module is None else module.low_rank_term  # type: ignore[no-any-return]


def decode_layers() -> type | None:
    """``csrc/decode_layers.cpp``'s ``DecodeLayers`` class; None where the kernels cannot run."""
    module = _module()
    return None if module is None else module.DecodeLayers  # type: ignore[no-any-return]


AMX_SWITCH = "PC_RAG_AMX"
"""Which quantized layers run on AMX where the CPU has it: ``0`` (the default: ATen's fused kernels), ``int8``
(the output projection) or ``all`` (int4 too). See ``amx_layers``."""
AMX_CHOICES = {"0": (), "int8": (8,), "all": (4, 8)}


def amx_layers() -> tuple[int, ...]:
    """The weight widths (4, 8) that ``PC_RAG_AMX`` puts on AMX; none by default. On the 2-core Xeon VM the AMX
    kernel makes a verify step's extra rows nearly free (``all``, SmolLM2 in int4 at 1K: 17.8 ms for one row, 20.1
    for four) but its dequant (an FMA and a bfloat16 rounding per weight) makes one row slower than ATen's kernels
    (12.2 and 19.3 ms), so whole answers with speculation got slower (``examples/switch_answers.py``,
    ``examples/results/amx_answers_xeon.json``)."""
    asked = os.environ.get(AMX_SWITCH, "0")
    if asked not in AMX_CHOICES:
        msg = f"{AMX_SWITCH}={asked!r}: expected one of {', '.join(AMX_CHOICES)}"
        raise ValueError(msg)
    return AMX_CHOICES[asked]


@functools.cache  # asked per quantized layer call: the CPU and the built module do not change in a process
def amx_linear() -> Callable[[torch.Tensor, torch.Tensor, torch.Tensor, int], torch.Tensor] | None:
    """``csrc/amx_linear.cpp``'s ``amx_linear(x, packed, scales, bits)`` (``weights.amx_pack``'s blocks); None
    unless the kernels are built and this CPU and process can use AMX (AMX-BF16 and AVX-512 BF16, the kernel's
    permission to use tile data, ``ATEN_CPU_CAPABILITY`` not below AVX-512). Which layers use it: ``amx_layers``."""
    if not getattr(torch.cpu, "_is_amx_tile_supported", lambda: False)():
        return None
    module = _module()
    if module is None or not module.amx_available():
        return None
    return module.amx_linear  # type: ignore[no-any-return]


DOT_SWITCH = "PC_RAG_DOT_LINEAR"
"""``0`` keeps ATen's fused kernels for a step's quantized layers where ``dot_linear`` would run (the default,
``1``). See ``dot_on``."""


def dot_on() -> bool:
    """Whether ``PC_RAG_DOT_LINEAR`` lets quantized layers take ``dot_linear`` (on by default). On the 2-core Zen 4
    VM a step's int4 layers of SmolLM2 took 2.77 ms for one row against ATen's 4.51 (3.64 against 6.73 for four
    rows), its int8 output projection 0.81 against 2.22 (``examples/results/quantized_kernels_zen4.json``)."""
    asked = os.environ.get(DOT_SWITCH, "1")
    if asked not in ("0", "1"):
        msg = f"{DOT_SWITCH}={asked!r}: expected 0 or 1"
        raise ValueError(msg)
    return asked == "1"


@functools.cache  # asked per quantized layer call: the CPU and the built module do not change in a process
def dot_linear() -> Callable[[torch.Tensor, torch.Tensor, torch.Tensor, int], torch.Tensor] | None:
    """``csrc/dot_linear.cpp``'s ``dot_linear(x, packed, scales, bits)`` (``weights.dot_pack``'s blocks); None
    unless the kernels are built and this CPU has AVX-512 BF16 (``ATEN_CPU_CAPABILITY`` not below AVX-512). Whether
    layers use it: ``dot_on``."""
    if not getattr(torch.cpu, "_is_avx512_bf16_supported", lambda: False)():
        return None
    module = _module()
    if module is None or not module.dot_available():
        return None
    return module.dot_linear  # type: ignore[no-any-return]
