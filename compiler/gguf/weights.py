"""GGUF tensors -> kiln weights: names mapped onto the kiln contract (model_config.param_shapes), llama.cpp's
q/k row permutation undone, and each tensor either dequantized with the `gguf` package or kept in its
quantized form where kiln has the same format (Q4_0 / Q4_1 -> int4 group 32, Q8_0 -> int8 group 32).

llama.cpp's converter permutes the rows of llama q/k projections within each head (it rotates interleaved
pairs, HF rotates halves); undoing it is a row permutation, so quantized blocks (which run along K) survive it.
"""

from __future__ import annotations

import os
import re
import sys
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from kiln.gguf.config import ROPE_FREQS, GGUFError, check_rope_freqs
from kiln.model_config import ModelConfig, param_shapes
from kiln.progress import PROGRESS_THRESHOLD
from kiln.quant.formats import QuantizedWeight

BLOCK = 32  # Q4_0, Q4_1 and Q8_0 blocks: 32 weights along K with one f16 scale (and Q4_1 an f16 minimum)
_SITE_NAMES = {"attn_norm": "norm0.weight", "ffn_norm": "norm1.weight",
               "attn_q": "attn0.q", "attn_k": "attn0.k", "attn_v": "attn0.v", "attn_output": "attn0.o",
               "attn_q_norm": "attn0.q_norm.weight", "attn_k_norm": "attn0.k_norm.weight",  # qwen3
               "ffn_gate": "mlp0.gate", "ffn_up": "mlp0.up", "ffn_down": "mlp0.down"}
_TOP = {"token_embd.weight": "embed.weight", "output_norm.weight": "final_norm.weight",
        "output.weight": "lm_head.weight"}
_BLK = re.compile(r"blk\.(\d+)\.(\w+)\.(weight|bias)")
KEEP_TYPES = ("Q4_0", "Q4_1", "Q8_0")  # the GGML types kiln runs as they are


@dataclass
class GGUFWeights:
    """Weights read from a GGUF: dense tensors by kiln name, quantized ones kept as QuantizedWeight, and the
    path each GGUF tensor took (for the load line)."""

    dense: dict[str, torch.Tensor] = field(default_factory=dict)
    quantized: dict[str, QuantizedWeight] = field(default_factory=dict)
    paths: dict[str, list[str]] = field(default_factory=dict)  # "Q4_1 -> int4 g32 (kept)": [kiln names]

    def summary(self) -> str:
        return paths_summary(self.paths)


def kiln_name(gguf_name: str) -> str | None:
    """The kiln weight name of a GGUF tensor name, or None for tensors kiln does not use."""
    if gguf_name in _TOP:
        return _TOP[gguf_name]
    m = _BLK.fullmatch(gguf_name)
    if not m or m.group(2) not in _SITE_NAMES:
        return None
    layer, part, kind = m.groups()
    site = _SITE_NAMES[part]
    return f"layers.{layer}.{site}" if site.endswith(".weight") else f"layers.{layer}.{site}.{kind}"


def _unpermute(rows: np.ndarray, heads: int) -> np.ndarray:
    """Undo llama.cpp's per-head row permutation (interleaved rotary pairs -> rotate-half order)."""
    half = rows.shape[0] // heads // 2
    return rows.reshape(heads, half, 2, *rows.shape[1:]).swapaxes(1, 2).reshape(rows.shape)


def _blocks(t: Any) -> np.ndarray:
    """The raw bytes of a block-quantized [N, K] tensor as [N, K / 32, bytes per block]."""
    n = int(t.shape[1]) if len(t.shape) > 1 else 1
    return np.asarray(t.data).reshape(n, -1, t.data.shape[-1] // (int(t.shape[0]) // BLOCK))


def keep_quantized(t: Any, perm_heads: int | None) -> QuantizedWeight:
    """A Q4_0 / Q4_1 / Q8_0 tensor in kiln's stored form, codes and scales copied bit for bit (no requantizing)."""
    kind = t.tensor_type.name
    b = _blocks(t)
    if perm_heads:
        b = _unpermute(b, perm_heads)
    n, groups, _ = b.shape
    d = torch.from_numpy(np.ascontiguousarray(b[..., :2]).view(np.float16)[..., 0].astype(np.float32))
    if kind == "Q8_0":
        codes = torch.from_numpy(np.ascontiguousarray(b[..., 2:]).view(np.int8).reshape(n, groups * BLOCK))
        return QuantizedWeight(codes, d.contiguous(), None, 8, BLOCK)
    mins = None
    qs = b[..., 4:] if kind == "Q4_1" else b[..., 2:]
    if kind == "Q4_1":
        mins = torch.from_numpy(np.ascontiguousarray(b[..., 2:4]).view(np.float16)[..., 0].astype(np.float32))
    # GGML packs element j in the low nibble and j + 16 in the high nibble of byte j: kiln's int4 layout
    # (kiln.quant.formats, layout version 2), so the bytes are kept as they are.
    packed = torch.from_numpy(np.ascontiguousarray(qs).reshape(n, groups * (BLOCK // 2)))
    return QuantizedWeight(packed, d.contiguous(), mins.contiguous() if mins is not None else None, 4, BLOCK)


def dequantized(t: Any, perm_heads: int | None) -> torch.Tensor:
    """A tensor as fp32 through the gguf package's own dequantization, in torch's [N, K] order."""
    from gguf.quants import dequantize

    arr = dequantize(np.asarray(t.data), t.tensor_type)
    arr = np.asarray(arr, dtype=np.float32).reshape([int(s) for s in reversed(t.shape)])
    if perm_heads:
        arr = _unpermute(arr, perm_heads)
    return torch.from_numpy(arr if arr.flags.writeable and arr.flags.c_contiguous else arr.copy())


def _path(t: Any, name: str, keep: bool, dtype: torch.dtype) -> tuple[bool, str]:
    """(kept quantized?, the path's label) for one GGUF tensor: its type alone decides, no data is read."""
    kind = t.tensor_type.name
    # Linears only: the embedding is gathered by row (a tied lm_head shares it), and the lm_head stays dense as
    # with kiln's own schemes (the step graph's row gather before it expects a plain linear).
    linear = len(t.shape) == 2 and name not in ("embed.weight", "lm_head.weight") and int(t.shape[0]) % BLOCK == 0
    if keep and kind in KEEP_TYPES and linear:
        return True, f"{kind} -> {'int8' if kind == 'Q8_0' else 'int4'} g32 (kept)"
    note = "" if kind in ("F32", "F16", "BF16") else " (dequantized)"
    return False, f"{kind} -> {str(dtype).removeprefix('torch.')}{note}"


def gguf_paths(reader: Any, *, keep: bool, dtype: torch.dtype) -> dict[str, list[str]]:
    """Which path each kiln weight of the GGUF would take on loading ("Q4_1 -> int4 g32 (kept)": [kiln names]),
    from the tensor types alone: what `kiln compile` reports without loading the weights."""
    paths: dict[str, list[str]] = {}
    for t in reader.tensors:
        name = kiln_name(t.name)
        if name is not None:
            paths.setdefault(_path(t, name, keep, dtype)[1], []).append(name)
    return paths


def paths_summary(paths: dict[str, list[str]]) -> str:
    """"120 Q4_1 -> int4 g32 (kept); 61 F32 -> float32": the load line's and `kiln compile`'s wording."""
    return "; ".join(f"{len(v)} {k}" for k, v in sorted(paths.items()))


def load_gguf_weights(
    reader: Any,
    path: str | os.PathLike,
    cfg: ModelConfig,
    *,
    arch: str,
    keep: bool = True,
    dtype: torch.dtype = torch.float32,
    device: str | torch.device = "cpu",
    progress: bool | None = None,
) -> GGUFWeights:
    """Every kiln weight of `cfg` from the GGUF. keep: Q4_0 / Q4_1 / Q8_0 linears stay quantized (int4 / int8,
    group 32); otherwise (and for every other type) tensors are dequantized and cast to `dtype`.
    progress: a bar on stderr counting the file's bytes read; None shows it for files over 1 GiB of tensors.

    A missing, unexpected or wrongly shaped tensor is one GGUFError listing them all; nothing is loaded then.
    """
    shapes = param_shapes(cfg)
    by_name: dict[str, Any] = {}
    problems = []
    for t in reader.tensors:
        name = kiln_name(t.name)
        if name is None:
            if t.name != ROPE_FREQS:  # not a weight: checked against the model's rope scaling below
                problems.append(f"tensor {t.name} has no kiln counterpart")
            continue
        if name not in shapes:
            problems.append(f"tensor {t.name} ({name}) is not in the model")
            continue
        got = tuple(int(s) for s in reversed(t.shape))
        if got != shapes[name]:
            problems.append(f"tensor {t.name} has shape {list(got)}, {name} needs {list(shapes[name])}")
        by_name[name] = t
    problems += [f"no tensor for {n}" for n in shapes if n not in by_name]
    check_rope_freqs(reader, path, cfg)
    if problems:
        raise GGUFError(f"{path}: the tensors do not match model {cfg.name!r} ({len(problems)} problems):\n  "
                        + "\n  ".join(problems[:20]))
    from tqdm import tqdm

    out = GGUFWeights()
    permute = arch in ("llama", "mistral")
    total = sum(int(t.n_bytes) for t in by_name.values())
    show = progress if progress is not None else total > PROGRESS_THRESHOLD
    with tqdm(total=total, unit="B", unit_scale=True, desc="kiln: loading weights", file=sys.stderr,
              disable=not show) as bar:
        for name, t in by_name.items():
            heads = None
            if permute and name.endswith(".q.weight"):
                heads = cfg.heads
            elif permute and name.endswith(".k.weight"):
                heads = cfg.kv_heads
            kind = t.tensor_type.name
            kept, path_label = _path(t, name, keep, dtype)
            try:
                if kept:
                    out.quantized[name] = keep_quantized(t, heads)
                else:
                    out.dense[name] = dequantized(t, heads).to(device=device, dtype=dtype)
            except (NotImplementedError, ValueError) as e:
                raise GGUFError(f"{path}: cannot dequantize tensor {t.name} of type {kind} ({e}); upgrade the gguf "
                                "package (pip install -U gguf) or convert the file to a common type (Q8_0, Q4_K, F16)"
                                ) from None
            out.paths.setdefault(path_label, []).append(name)
            bar.update(int(t.n_bytes))
    for qw in out.quantized.values():
        for attr in ("qweight", "scales", "zeros"):
            if getattr(qw, attr) is not None:
                setattr(qw, attr, getattr(qw, attr).to(device))
    return out

