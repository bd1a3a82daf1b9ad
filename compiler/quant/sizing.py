"""What a quantization scheme does to a model, from its ModelConfig alone: which weights it quantizes, the int4
group a plain scheme name gets, and the bytes of the result. No torch here: `kiln check` uses it.

A scheme named without a group (`int4`, `int4-gptq`, a spec's `quantize = int4`) has `auto_group` set: it takes
group 128 when 128 divides the K (input size) of every weight it quantizes, else the largest of 64 / 32 that does
(SmolLM2-135M's K = 576 gets 64). A group named explicitly (`int4-g128`) is kept, and a K it does not divide stays
the quantize pass's error.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from kiln.model_config import INT4_GROUPS, ModelConfig, param_shapes

_LINEAR_SUFFIXES = tuple(f".{p}.weight" for p in ("q", "k", "v", "o", "gate", "up", "down"))
SCALE_BYTES = 4  # scales are fp32 whatever the model dtype (kiln.quant.formats)


def scheme_label(bits: int, method: str, group: int, symmetric: bool) -> str:
    """A scheme's short name: int8, int8-gptq, int4-rtn-g128, int4-gptq-g64-asym."""
    if bits == 8:
        return "int8" if method == "rtn" else "int8-gptq"
    return f"int4-{method}-g{group}" + ("" if symmetric else "-asym")


@dataclass(frozen=True)
class SchemeView:
    """The fields of a kiln.quant.formats.QuantScheme that sizing reads, made from a spec's `quantize` dict without
    torch (`kiln check`)."""

    bits: int = 8
    group: int = 0
    symmetric: bool = True
    method: str = "rtn"
    lm_head: bool = False
    embeddings: bool = False
    auto_group: bool = False

    @classmethod
    def of(cls, d: dict) -> SchemeView:
        return cls(**{f.name: d[f.name] for f in dataclasses.fields(cls) if f.name in d})

    @property
    def label(self) -> str:
        return scheme_label(self.bits, self.method, self.group, self.symmetric)


def quantized_weights(cfg: ModelConfig, *, lm_head: bool = False, embeddings: bool = False) -> dict[str, tuple]:
    """Name -> [N, K] of every weight the quantize pass takes for a scheme with these lm_head / embeddings flags
    (the linears of attention and MLP sites; the lm_head and the embedding tables only when asked)."""
    shapes = param_shapes(cfg)
    out = {n: s for n, s in shapes.items() if n.startswith("layers.") and n.endswith(_LINEAR_SUFFIXES)}
    if embeddings:
        out |= {n: shapes[n] for n in ("embed.weight", "pos_embed.weight") if n in shapes}
    if lm_head:  # a tied head reads the embedding table, which is then the weight quantized
        name = "lm_head.weight" if "lm_head.weight" in shapes else "embed.weight"
        out[name] = shapes[name]
    return out


def fitting_group(ks: list[int]) -> int | None:
    """The largest int4 group that divides every K, or None when none does."""
    return next((g for g in sorted(INT4_GROUPS, reverse=True) if all(k % g == 0 for k in ks)), None)


def resolve_group(scheme: Any, cfg: ModelConfig) -> tuple[Any, str | None]:
    """(the scheme with its int4 group fixed for this model, a note when that is not 128). `scheme` is a
    kiln.quant.formats.QuantScheme (any dataclass with its fields); only an `auto_group` one changes."""
    if scheme.bits != 4 or not getattr(scheme, "auto_group", False):
        return scheme, None
    weights = quantized_weights(cfg, lm_head=scheme.lm_head, embeddings=scheme.embeddings)
    group = fitting_group([s[1] for s in weights.values()]) or scheme.group  # none fits: the pass names the weight
    fixed = dataclasses.replace(scheme, group=group, auto_group=False)
    if group == scheme.group:
        return fixed, None
    name, shape = next((n, s) for n, s in weights.items() if s[1] % scheme.group)
    return fixed, (f"int4 without a group takes group {scheme.group} where it divides every K; {name} has "
                   f"K = {shape[1]}, so group {group} is used ({fixed.label})")


def quantized_bytes(cfg: ModelConfig, dtype_bytes: int, scheme: Any) -> int:
    """Bytes of the model's weights after `scheme` (a resolved scheme: see resolve_group): quantized codes, their
    fp32 scales (and int4 zeros when asymmetric), and every other weight at dtype_bytes per element."""
    shapes = param_shapes(cfg)
    quantized = quantized_weights(cfg, lm_head=scheme.lm_head, embeddings=scheme.embeddings)
    total = sum(_numel(s) for n, s in shapes.items() if n not in quantized) * dtype_bytes
    tied = "lm_head.weight" not in shapes
    if "embed.weight" in quantized and tied and not (scheme.lm_head and scheme.embeddings):
        total += _numel(shapes["embed.weight"]) * dtype_bytes  # the tied table's other reader keeps it dense
    for n, k in quantized.values():
        if scheme.bits == 8:
            total += n * k + n * SCALE_BYTES
        else:
            groups = n * (k // scheme.group)
            total += n * k // 2 + groups * SCALE_BYTES + (0 if scheme.symmetric else groups)
    return total


def _numel(shape: tuple) -> int:
    out = 1
    for d in shape:
        out *= d
    return out
