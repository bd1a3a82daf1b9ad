"""GGUF files (llama.cpp's format) read through the `gguf` package: open and check a file, metadata -> ModelConfig.

The metadata is translated into the config.json keys kiln's HF importer reads, so one code path
(hf_import.config_from_hf) decides what kiln can express. Every problem with the file itself (missing,
truncated, wrong magic, a tensor type the reader does not know) is one GGUFError naming the file and the fix.
"""

from __future__ import annotations

import functools
import math
import mmap
import os
import threading
import types
from pathlib import Path
from typing import Any

import numpy as np

from kiln.errors import KilnError
from kiln.hf.config import config_from_hf
from kiln.model_config import ModelConfig, RopeScaling

MAGIC = b"GGUF"
# GGUF architecture -> the HF model_type kiln's importer knows (its hyperparameter keys are prefixed by the arch).
ARCHITECTURES = {"llama": "llama", "mistral": "mistral", "qwen2": "qwen2", "qwen3": "qwen3"}
_FIX = "re-download or re-convert it with llama.cpp's convert_hf_to_gguf.py"


class GGUFError(KilnError):
    """A GGUF file kiln cannot read or cannot map onto a kiln model."""


def open_gguf(path: str | os.PathLike) -> Any:
    """A gguf.GGUFReader over `path` (memory-mapped; nothing is dequantized yet), or GGUFError.

    Readers are cached per (path, size, mtime): parsing the metadata of a 49k-token vocabulary takes seconds.
    """
    path = Path(path)
    if path.is_dir():  # a name ending in .gguf is not enough: say what it is (commands take these paths by flag or not)
        raise GGUFError(f"{path}: is a directory, not a GGUF file; give the .gguf file itself (or, for a Hugging Face "
                        "checkpoint directory, a name not ending in .gguf)")
    if not path.is_file():
        raise GGUFError(f"{path}: no such GGUF file; check the path")
    st = path.stat()
    return _open(str(path.resolve()), st.st_size, st.st_mtime_ns)


class _PlainMapNumpy(types.ModuleType):
    """numpy for gguf's reader module, except that memmap(path, mode="r") maps the file as a plain read-only
    ndarray. The reader slices its map a few times per metadata value (about 250k slices for a 49k-token vocabulary
    and its merges); np.memmap runs a Python __array_finalize__ on every slice, which makes parsing 3x slower than
    over a plain array viewing the same pages. Nothing is copied either way: tensor data stays lazily mapped."""

    def __init__(self) -> None:
        super().__init__("numpy")
        self.__dict__.update({k: v for k, v in vars(np).items() if not k.startswith("__")})  # plain lookups
        self.memmap = _plain_map

    def __getattr__(self, name: str) -> Any:  # what vars(np) lacks (numpy's lazily loaded submodules)
        return getattr(np, name)


def _plain_map(path: str | os.PathLike, mode: str = "r") -> np.ndarray:
    assert mode == "r", mode
    with open(path, "rb") as f:
        return np.frombuffer(mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ), dtype=np.uint8)


_PLAIN_NUMPY = _PlainMapNumpy()
_READER_LOCK = threading.Lock()  # the swap below is of a module global: one reader is built at a time


def _read(path: Path) -> Any:
    """gguf.GGUFReader(path, "r") built over a plain mapping of the file (see _PlainMapNumpy)."""
    import gguf.gguf_reader as reader_module

    with _READER_LOCK:
        saved, reader_module.np = reader_module.np, _PLAIN_NUMPY
        try:
            return reader_module.GGUFReader(path, "r")
        finally:
            reader_module.np = saved


@functools.lru_cache(maxsize=2)
def _open(name: str, size: int, mtime_ns: int) -> Any:
    path = Path(name)
    with path.open("rb") as f:
        head = f.read(4)
    if head != MAGIC:
        raise GGUFError(f"{path}: not a GGUF file (starts with {head!r}, expected {MAGIC!r}); the file is damaged or "
                        "of another format: give a .gguf file (or a Hugging Face checkpoint directory for weights)")
    try:
        reader = _read(path)
    except ValueError as e:  # the reader's error for an unknown tensor type or a bad header value
        text = str(e)
        if "is not a valid GGMLQuantizationType" in text:
            raise GGUFError(f"{path}: a tensor has an unknown GGML type ({text}); convert the file with a llama.cpp "
                            "of the same age as the installed `gguf` package, or upgrade it (pip install -U gguf)"
                            ) from None
        raise GGUFError(f"{path}: cannot read the GGUF header ({text}); the file is damaged: {_FIX}") from None
    except (IndexError, OSError, KeyError, TypeError, OverflowError, MemoryError) as e:
        raise GGUFError(f"{path}: the file is truncated or damaged ({type(e).__name__}: {e}); {_FIX}") from None
    _check_extent(path, reader)
    return reader


def _check_extent(path: Path, reader: Any) -> None:
    """A file cut inside its tensor data still parses (numpy memmaps lazily): check every tensor fits."""
    size = path.stat().st_size
    for t in reader.tensors:
        if t.data_offset + t.n_bytes > size:
            raise GGUFError(f"{path}: truncated: tensor {t.name} needs bytes up to {t.data_offset + t.n_bytes} but "
                            f"the file has {size}; {_FIX}")


def field(reader: Any, key: str, default: Any = None) -> Any:
    """A metadata value as a Python value (str, int, float, bool or list), or `default` when absent."""
    f = reader.fields.get(key)
    if f is None:
        return default
    return f.contents()


def architecture(reader: Any, path: str | os.PathLike) -> str:
    arch = field(reader, "general.architecture")
    if arch not in ARCHITECTURES:
        raise GGUFError(f"{path}: GGUF architecture {arch!r} is not supported; kiln loads "
                        f"{', '.join(ARCHITECTURES)} (convert a supported model, or write a spec and use HF weights)")
    return arch


def hf_config(reader: Any, path: str | os.PathLike) -> dict:
    """The config.json a Hugging Face checkpoint of this model would have (the keys kiln's importer reads)."""
    arch = architecture(reader, path)
    names = {t.name for t in reader.tensors}

    def need(key: str) -> Any:
        value = field(reader, f"{arch}.{key}")
        if value is None:
            raise GGUFError(f"{path}: metadata {arch}.{key} is missing; {_FIX}")
        return value

    heads = int(need("attention.head_count"))
    dim = int(need("embedding_length"))
    tokens = field(reader, "tokenizer.ggml.tokens")
    vocab = field(reader, f"{arch}.vocab_size") or (len(tokens) if tokens is not None else None)
    embd = next((t for t in reader.tensors if t.name == "token_embd.weight"), None)
    if vocab is None and embd is not None:
        vocab = int(embd.shape[-1])
    if vocab is None:
        raise GGUFError(f"{path}: neither {arch}.vocab_size nor a token list says the vocabulary size; {_FIX}")
    head_dim = field(reader, f"{arch}.attention.key_length") or field(reader, f"{arch}.rope.dimension_count")
    hf: dict[str, Any] = {
        "model_type": ARCHITECTURES[arch],
        "vocab_size": int(vocab),
        "hidden_size": dim,
        "num_hidden_layers": int(need("block_count")),
        "num_attention_heads": heads,
        "num_key_value_heads": int(field(reader, f"{arch}.attention.head_count_kv") or heads),
        "head_dim": int(head_dim or dim // heads),
        "intermediate_size": int(need("feed_forward_length")),
        "max_position_embeddings": int(field(reader, f"{arch}.context_length", 4096)),
        "rms_norm_eps": _f32(field(reader, f"{arch}.attention.layer_norm_rms_epsilon", 1e-5)),
        "rope_theta": _f32(field(reader, f"{arch}.rope.freq_base", 10000.0)),
        "hidden_act": "silu",
        "tie_word_embeddings": "output.weight" not in names,
        "attention_bias": "blk.0.attn_q.bias" in names and arch != "qwen2",
    }
    kind = field(reader, f"{arch}.rope.scaling.type")
    llama3 = scaling_from_gguf(reader, path, arch, hf["rope_theta"], hf["head_dim"])
    if llama3 is not None:
        hf["rope_scaling"] = {"rope_type": "llama3", "factor": llama3.factor, "low_freq_factor": llama3.low_freq_factor,
                              "high_freq_factor": llama3.high_freq_factor,
                              "original_max_position_embeddings": llama3.original_context}
    elif kind not in (None, "none"):
        factor = field(reader, f"{arch}.rope.scaling.factor")
        hf["rope_scaling"] = {"rope_type": kind, "factor": factor}
    window = field(reader, f"{arch}.attention.sliding_window")
    if window:
        hf["sliding_window"] = int(window)
        hf["use_sliding_window"] = True
    return hf


def config_from_gguf(reader: Any, path: str | os.PathLike, name: str = "") -> ModelConfig:
    """The ModelConfig of a GGUF model; `name` defaults to the file's general.name, else its stem."""

    hf = hf_config(reader, path)
    name = name or _slug(str(field(reader, "general.name") or Path(path).stem))
    try:
        return config_from_hf(hf, name=name)
    except GGUFError:
        raise
    except KilnError as e:
        raise GGUFError(f"{path}: {e}") from None


def _f32(value: float) -> float:
    """A float32 metadata value as the shortest decimal that reads back as it (1e-05, not 9.99999974e-06)."""
    return float(str(np.float32(value)))


def _slug(text: str) -> str:
    return "-".join(text.lower().replace("_", " ").split()) or "gguf-model"


# ---- llama3 rope scaling --------------------------------------------------------------------------------------
# llama.cpp's converter stores llama3 rope scaling as the tensor rope_freqs.weight (one divisor per rotary pair),
# not as parameters. kiln maps it back onto RopeScaling("llama3", ...) and checks that those parameters produce the
# tensor, so it is consumed, never silently dropped. GGUF has keys for the factor and the original context but none
# for the low / high frequency factors: absent keys take what the converter assumes (factor: the largest divisor,
# which the longest wavelengths get; low 1, high 4, original 8192: every Llama 3.x), or the non-standard
# {arch}.rope.scaling.low_freq_factor / high_freq_factor when a file has them.
ROPE_FREQS = "rope_freqs.weight"


def rope_freqs(reader: Any) -> np.ndarray | None:
    """The file's rope_freqs divisors as float64, or None when it has none."""
    t = next((t for t in reader.tensors if t.name == ROPE_FREQS), None)
    if t is None:
        return None
    from gguf.quants import dequantize  # lazy, as GGUFReader above: the gguf package loads only to read a file

    return np.asarray(dequantize(np.asarray(t.data), t.tensor_type), dtype=np.float64).reshape(-1)


def llama3_divisors(theta: float, head_dim: int, s: RopeScaling) -> np.ndarray:
    """Per-pair divisors of the rotary frequencies under llama3 scaling (what the converter writes)."""
    freqs = 1.0 / theta ** (np.arange(0, head_dim, 2, dtype=np.float32).astype(np.float64) / head_dim)
    wavelen = 2 * math.pi / freqs
    smooth = (s.original_context / wavelen - s.low_freq_factor) / (s.high_freq_factor - s.low_freq_factor)
    mid = 1 / ((1 - smooth) / s.factor + smooth)
    high, low = s.original_context / s.high_freq_factor, s.original_context / s.low_freq_factor
    return np.where(wavelen < high, 1.0, np.where(wavelen > low, s.factor, mid))


def _mismatch(have: np.ndarray, want: np.ndarray) -> str | None:
    """None when the tensor is the divisors to float32 rounding, else where it differs most."""
    if have.shape != want.shape:
        return f"{have.size} values, {want.size} expected (head_dim / 2)"
    err = np.abs(have - want) / np.abs(want)
    if np.all(err <= 1e-5):
        return None
    i = int(np.argmax(err))
    return f"rope_freqs[{i}] is {have[i]:.6g} where the parameters give {want[i]:.6g}"


def _describe(s: RopeScaling) -> str:
    return (f"llama3(factor = {s.factor:g}, low = {s.low_freq_factor:g}, high = {s.high_freq_factor:g}, "
            f"original = {s.original_context})")


def scaling_from_gguf(reader: Any, path: str | os.PathLike, arch: str, theta: float,
                      head_dim: int) -> RopeScaling | None:
    """The llama3 RopeScaling a file's rope_freqs stands for (None without the tensor); GGUFError naming the file
    and the mismatch when the parameters do not produce the tensor."""
    have = rope_freqs(reader)
    if have is None:
        return None
    kind = field(reader, f"{arch}.rope.scaling.type")
    if kind not in (None, "none"):
        raise GGUFError(f"{path}: the file carries both {ROPE_FREQS} (llama3 rope scaling) and "
                        f"{arch}.rope.scaling.type = {kind!r}; kiln applies one rope scaling; {_FIX}")

    def key(name: str, default: float) -> float:
        value = field(reader, f"{arch}.rope.scaling.{name}")
        return _f32(value) if value is not None else default

    s = RopeScaling("llama3", factor=key("factor", _f32(float(have.max())) if have.size else 1.0),
                    low_freq_factor=key("low_freq_factor", 1.0), high_freq_factor=key("high_freq_factor", 4.0),
                    original_context=int(key("original_context_length", 8192)))
    problem = _mismatch(have, llama3_divisors(theta, head_dim, s))
    if problem is not None:
        raise GGUFError(f"{path}: {ROPE_FREQS} is not the llama3 rope scaling of the file's metadata (absent keys "
                        f"read as llama.cpp's defaults), {_describe(s)}: {problem}; kiln cannot apply other "
                        "per-frequency factors; re-convert the file with llama.cpp's convert_hf_to_gguf.py from a "
                        "checkpoint with llama3 rope_scaling")
    return s


def check_rope_freqs(reader: Any, path: str | os.PathLike, cfg: ModelConfig) -> None:
    """A model given by a spec must apply the scaling the file's rope_freqs holds (nothing to check without it)."""
    have = rope_freqs(reader)
    if have is None:
        return
    s = cfg.rope.scaling if cfg.rope is not None else None
    fix = "drop the spec (kiln reads the model from the file), or give its rope the file's llama3 scaling"
    if s is None or s.kind != "llama3":
        raise GGUFError(f"{path}: {ROPE_FREQS} holds llama3 rope scaling but model {cfg.name!r} has "
                        f"{'no rope scaling' if s is None else s.kind + ' rope scaling'}; {fix}")
    problem = _mismatch(have, llama3_divisors(cfg.rope.theta, cfg.head_dim, s))
    if problem is not None:
        raise GGUFError(f"{path}: {ROPE_FREQS} does not match model {cfg.name!r}'s rope scaling {_describe(s)}: "
                        f"{problem}; {fix}")
