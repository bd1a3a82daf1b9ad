"""The matching rules of kiln.dynamo.normalize: one function per canonical op name, each reading its inputs' abstract
states and either setting its own node's state or claiming a kiln op.

States (St.kind, St.x, St.p) and what they mean for the node's value:
  same x            equal to x (contiguous, clone, same-dtype cast, eval dropout, *1.0, cat with empty tensors);
                    like every state, only between values no in-place op of the graph writes
  heads src         src [B, T, H*D] viewed as [B, T, H, D] (form bthd) or transposed to [B, H, T, D] (bhtd)
  f32 x / sq / ms / ms_eps / inv_rms / normed / normed_cast   the steps of HF's RMSNorm on x
  posu / posf pos / freqs / emb / cos / sin                   HF's rotary tables from position ids and inv_freq
  half0 / half1 / neghalf / rot q, qcos / rotsin q            rotate_half(q) and the two products of RoPE
  unsq2 / rep_exp / rep src                                   repeat_kv (None-index, expand, reshape)
  kT / scores / probs                                         eager attention: q @ k^T * scale (+ mask), softmax
  halfx / cube / ccube / inner / garg / tanh / oneplus x      the tanh-GELU formula (HF's gelu_new)
"""

from __future__ import annotations

import math

from torch import fx

from kiln.dynamo.claims import claim_act, claim_attention, claim_layer_norm, claim_linear
from kiln.dynamo.fx_query import Op, scalar, tensor
from kiln.dynamo.mutation import writes
from kiln.dynamo.normalize import MaskSpec, Normalizer, resolve
from kiln.dynamo.rules_formulas import _add, _div, _matmul, _mean, _mul, _neg, _pow, _rsqrt, _softmax, _tanh, _trig
from kiln.dynamo.rules_layout import (
    _cast,
    _cat,
    _contiguous,
    _dropout,
    _expand,
    _getitem,
    _reshape,
    _transpose,
    _unsqueeze,
)

_ACTS = {"silu": "silu", "relu": "relu"}


def _sdpa(nz: Normalizer, node: fx.Node, op: Op) -> None:
    q, k, v = (resolve(nz, a) for a in op.args[:3])
    mask, dropout, causal = op.arg(3, "attn_mask"), op.arg(4, "dropout_p", 0.0), op.arg(5, "is_causal", False)
    scale, gqa = op.arg(6, "scale"), op.kwargs.get("enable_gqa", False)
    tq = tensor(q)
    if tq is None or tq.dim() != 4:
        return nz.reject(node, "attention", "sdpa query is not a 4-D [B, H, T, D] tensor")
    if dropout != 0:
        return nz.reject(node, "attention", f"dropout_p={dropout} (kiln attention has no dropout)")
    if not isinstance(causal, bool) or not isinstance(gqa, bool):
        return nz.reject(node, "attention", "is_causal / enable_gqa are not constants")
    scale = scale if scale is not None else (1.0 / math.sqrt(tq.shape[-1]) if isinstance(tq.shape[-1], int) else None)
    scale = scalar(scale)
    if scale is None:
        return nz.reject(node, "attention", "scale is not a constant")
    claim_attention(nz, node, q, k, v, mask, causal, scale, gqa)


def _linear(nz: Normalizer, node: fx.Node, op: Op) -> None:
    claim_linear(nz, node, resolve(nz, op.args[0]), op.arg(1, "weight"), op.arg(2, "bias"))


def _act(nz: Normalizer, node: fx.Node, op: Op) -> None:
    kind = _ACTS.get(op.name)
    if op.name == "gelu":
        kind = {"none": "gelu", "tanh": "gelu_tanh"}.get(op.arg(1, "approximate", "none"))
    if kind is not None and not writes(node):  # F.relu(x, inplace=True) returns x changed: left to torch
        claim_act(nz, node, resolve(nz, op.args[0]), kind)


def _layer_norm(nz: Normalizer, node: fx.Node, op: Op) -> None:
    args = (op.arg(1, "normalized_shape"), op.arg(2, "weight"), op.arg(3, "bias"), op.arg(4, "eps", 1e-5))
    claim_layer_norm(nz, node, resolve(nz, op.args[0]), *args)


RULES = {
    "reshape": _reshape, "transpose": _transpose, "contiguous": _contiguous, "clone": _contiguous, "cast": _cast,
    "dropout": _dropout, "getitem": _getitem, "unsqueeze": _unsqueeze, "expand": _expand, "cat": _cat, "cos": _trig,
    "sin": _trig, "neg": _neg, "tanh": _tanh, "rsqrt": _rsqrt, "pow": _pow, "mean": _mean, "softmax": _softmax,
    "div": _div, "add": _add, "mul": _mul, "matmul": _matmul, "sdpa": _sdpa, "linear": _linear, "silu": _act,
    "relu": _act, "gelu": _act, "layer_norm": _layer_norm,
}  # fmt: skip


def normalize(gm: fx.GraphModule, mask_spec: MaskSpec | None = None, off: frozenset[str] = frozenset()) -> Normalizer:
    """Rewrite gm in place with RULES, claiming no op in `off`; the returned Normalizer holds the claims,
    rejections and claimed masks."""
    return Normalizer(gm, mask_spec, off).run(RULES)
