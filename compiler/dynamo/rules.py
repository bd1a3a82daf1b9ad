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

import torch
from torch import fx

from kiln.dynamo.claims import (
    claim_act,
    claim_attention,
    claim_gated,
    claim_layer_norm,
    claim_linear,
    claim_rms,
    claim_rope,
)
from kiln.dynamo.fx_query import Op, is_kiln, same, same_shape, scalar, tensor
from kiln.dynamo.mutation import writes
from kiln.dynamo.normalize import MaskSpec, Normalizer, St, kiln_ops, resolve

_FLOATS = (torch.float32, torch.float16, torch.bfloat16)
_ACTS = {"silu": "silu", "relu": "relu"}


def _dim(d: object, ndim: int) -> int | None:
    return d % ndim if isinstance(d, int) and ndim > 0 else None


def _st(nz: Normalizer, n: object, *kinds: str) -> St | None:
    s = nz.st.get(n) if isinstance(n, fx.Node) else None
    return s if s is not None and s.kind in kinds else None


def _pass(nz: Normalizer, node: fx.Node, x: object) -> None:
    if isinstance(x, fx.Node) and tensor(x) is not None:
        nz.st[node] = nz.st.get(x) or St("same", x)


def _f32_of(nz: Normalizer, n: object) -> fx.Node | None:
    """The tensor whose fp32 version n is (n itself when it already is fp32)."""
    s = _st(nz, n, "f32")
    if s is not None:
        return resolve(nz, s.x)
    t = tensor(n)
    return resolve(nz, n) if t is not None and t.dtype == torch.float32 else None


def _float_tensor(n: object) -> bool:
    t = tensor(n)
    return t is not None and t.dtype in _FLOATS


# ---- layout -------------------------------------------------------------------------------------------------


def _reshape(nz: Normalizer, node: fx.Node, op: Op) -> None:
    x, out = op.args[0], tensor(node)
    xin = tensor(x)
    if xin is None or out is None:
        return
    s = nz.st.get(x)
    if s is not None and s.kind == "heads" and s.p["form"] == "bthd" and out.dim() == 3:
        if same_shape(out.shape, tensor(s.x).shape) and not nz.replace(node, s.x):
            nz.st[node] = St("same", s.x)
    elif s is not None and s.kind == "rep_exp" and out.dim() == 4:
        b, hkv, slen, d = tensor(s.x).shape
        if same_shape(out.shape, (b, hkv * s.p["rep"], slen, d)):
            nz.st[node] = St("rep", s.x, s.p)
    elif xin.dim() == 3 and out.dim() == 4 and same_shape(out.shape[:2], xin.shape[:2]):
        h, d = out.shape[2], out.shape[3]
        if isinstance(h, int) and isinstance(d, int) and same(h * d, xin.shape[2]):
            nz.st[node] = St("heads", resolve(nz, x), {"form": "bthd", "H": h, "D": d})


def _transpose(nz: Normalizer, node: fx.Node, op: Op) -> None:
    x, t = op.args[0], tensor(op.args[0])
    if t is None or t.dim() != 4:
        return
    dims = sorted((_dim(op.arg(1, "dim0"), 4), _dim(op.arg(2, "dim1"), 4)))
    s = _st(nz, x, "heads")
    if dims == [1, 2] and s is not None:
        nz.st[node] = St("heads", s.x, {**s.p, "form": "bhtd" if s.p["form"] == "bthd" else "bthd"})
    elif dims == [2, 3]:
        nz.st[node] = St("kT", resolve(nz, x))


def _contiguous(nz: Normalizer, node: fx.Node, op: Op) -> None:
    _pass(nz, node, op.args[0])


def _dropout(nz: Normalizer, node: fx.Node, op: Op) -> None:
    if op.arg(1, "p", 0.5) == 0 or op.arg(2, "training", True) is False:
        _pass(nz, node, op.args[0])


def _cast(nz: Normalizer, node: fx.Node, op: Op) -> None:
    x = op.args[0]
    t, out = tensor(x), tensor(node)
    if t is None or out is None or t.device != out.device:
        return
    s = nz.st.get(x)
    if out.dtype == t.dtype:
        _pass(nz, node, x)
    elif s is not None and s.kind == "normed" and out.dtype == tensor(s.x).dtype:
        nz.st[node] = St("normed_cast", s.x, s.p)
    elif s is not None and s.kind in ("cos", "sin"):
        nz.st[node] = St(s.kind, s.x, {**s.p, "dtype": out.dtype})
    elif s is not None and s.kind == "posu" and out.dtype == torch.float32:
        nz.st[node] = St("posf", s.x)
    elif s is not None and s.kind == "probs":
        nz.st[node] = s  # softmax probabilities back in q's dtype: kiln keeps them in fp32 inside the kernel
    elif s is None and out.dtype == torch.float32 and t.dtype in _FLOATS:
        nz.st[node] = St("f32", resolve(nz, x))


def _getitem(nz: Normalizer, node: fx.Node, op: Op) -> None:
    x, idx, t = op.args[0], op.args[1], tensor(op.args[0])
    if t is None or not isinstance(idx, tuple) or sum(i is Ellipsis for i in idx) > 1:
        return
    if Ellipsis in idx:  # spell the index out over every dim
        k = idx.index(Ellipsis)
        fill = t.dim() - sum(i is not None and i is not Ellipsis for i in idx)
        idx = idx[:k] + (slice(None),) * fill + idx[k + 1 :]
    full = slice(None)
    if t.dim() == 4 and idx == (full, full, None, full, full):
        nz.st[node] = St("unsq2", resolve(nz, x))
    elif t.dim() == 2 and idx == (full, full, None) and not t.dtype.is_floating_point:
        nz.st[node] = St("posu", resolve(nz, x))
    elif len(idx) == t.dim() == 4 and all(i == full for i in idx[:3]) and isinstance(idx[3], slice):
        d, sl = t.shape[3], idx[3]
        if isinstance(d, int) and d % 2 == 0 and sl.step in (None, 1):
            if sl.start in (None, 0) and sl.stop == d // 2:
                nz.st[node] = St("half0", resolve(nz, x))
            elif sl.start == d // 2 and sl.stop in (None, d):
                nz.st[node] = St("half1", resolve(nz, x))


def _unsqueeze(nz: Normalizer, node: fx.Node, op: Op) -> None:
    x, t = op.args[0], tensor(op.args[0])
    if t is None:
        return
    d = _dim(op.arg(1, "dim"), t.dim() + 1)
    s = _st(nz, x, "cos", "sin")
    if s is not None and t.dim() == 3 and s.p.get("axis") is None and d in (1, 2):
        nz.st[node] = St(s.kind, s.x, {**s.p, "axis": d})
    elif t.dim() == 2 and d == 2 and not t.dtype.is_floating_point:
        nz.st[node] = St("posu", resolve(nz, x))


def _expand(nz: Normalizer, node: fx.Node, op: Op) -> None:
    s, out = _st(nz, op.args[0], "unsq2"), tensor(node)
    if s is None or out is None or out.dim() != 5:
        return
    b, hkv, slen, d = tensor(s.x).shape
    rep = out.shape[2]
    if isinstance(rep, int) and same_shape(out.shape, (b, hkv, rep, slen, d)):
        nz.st[node] = St("rep_exp", s.x, {"rep": rep})


def _cat(nz: Normalizer, node: fx.Node, op: Op) -> None:
    parts, t = op.arg(0, "tensors"), tensor(node)
    if not isinstance(parts, (list, tuple)) or t is None:
        return
    nonempty = [p for p in parts if not (tensor(p) is not None and same(tensor(p).numel(), 0))]
    if len(parts) > 1 and len(nonempty) == 1:  # cat([empty cache, k]) is k (unless an empty part promotes it)
        x = nonempty[0]
        if tensor(x) is None or tensor(x).dtype != t.dtype:
            return
        _pass(nz, node, x)
        # As a fresh tensor in cat's strides (contiguous): inductor's decomposition clones x keeping its layout,
        # so a KV cache started from a transposed k would come back non-contiguous and recompile the next step.
        copy = nz.restride(x, node) if isinstance(x, fx.Node) and node not in nz.written else None
        if copy is not None and copy is not x and node in nz.st:
            nz.st[copy] = nz.st[node]
            node.replace_all_uses_with(copy)
        return
    if len(parts) != 2 or _dim(op.arg(1, "dim", 0), t.dim()) != t.dim() - 1:
        return
    a, b = parts
    fa, ng, h0 = _st(nz, a, "freqs"), _st(nz, a, "neghalf"), _st(nz, b, "half0")
    if fa is not None and resolve(nz, a) is resolve(nz, b):
        nz.st[node] = St("emb", fa.x, fa.p)
    elif ng is not None and h0 is not None and ng.x is h0.x:
        nz.st[node] = St("rot", ng.x)


def _trig(nz: Normalizer, node: fx.Node, op: Op) -> None:
    s = _st(nz, op.args[0], "emb")
    if s is not None:
        nz.st[node] = St(op.name, s.x, {"inv": s.p["inv"], "dtype": torch.float32, "axis": None})


def _neg(nz: Normalizer, node: fx.Node, op: Op) -> None:
    s = _st(nz, op.args[0], "half1")
    if s is not None:
        nz.st[node] = St("neghalf", s.x)


def _tanh(nz: Normalizer, node: fx.Node, op: Op) -> None:
    s = _st(nz, op.args[0], "garg")
    if s is not None:
        nz.st[node] = St("tanh", s.x)


def _rsqrt(nz: Normalizer, node: fx.Node, op: Op) -> None:
    s = _st(nz, op.args[0], "ms_eps")
    if s is not None:
        nz.st[node] = St("inv_rms", s.x, s.p)


def _pow(nz: Normalizer, node: fx.Node, op: Op) -> None:
    x, e = op.args[0], scalar(op.arg(1, "exponent"))
    base = _f32_of(nz, x)
    if e == 2 and base is not None:
        nz.st[node] = St("sq", base)
    elif e == 3 and _float_tensor(x):
        nz.st[node] = St("cube", resolve(nz, x))


def _mean(nz: Normalizer, node: fx.Node, op: Op) -> None:
    s, t = _st(nz, op.args[0], "sq"), tensor(op.args[0])
    dim = op.arg(1, "dim")
    dim = dim[0] if isinstance(dim, (list, tuple)) and len(dim) == 1 else dim
    if s is not None and _dim(dim, t.dim()) == t.dim() - 1 and op.arg(2, "keepdim", False) is True:
        nz.st[node] = St("ms", s.x)


def _softmax(nz: Normalizer, node: fx.Node, op: Op) -> None:
    s, t = _st(nz, op.args[0], "scores"), tensor(op.args[0])
    if s is not None and _dim(op.arg(1, "dim"), 4) == 3 and op.arg(2, "dtype") in (None, torch.float32):
        nz.st[node] = St("probs", s.x, s.p) if t is not None else None


def _div(nz: Normalizer, node: fx.Node, op: Op) -> None:
    s, c = _st(nz, op.args[0], "scores"), scalar(op.arg(1, "other"))
    if s is not None and c and s.p["mask"] is None:
        nz.st[node] = St("scores", s.x, {**s.p, "scale": s.p["scale"] / c})


def _add(nz: Normalizer, node: fx.Node, op: Op) -> None:
    a, b = op.args[0], op.arg(1, "other")
    if op.kwargs.get("alpha", 1) != 1:
        return
    for x, y in ((a, b), (b, a)):
        s, c = nz.st.get(x) if isinstance(x, fx.Node) else None, scalar(y)
        if s is None:
            continue
        if s.kind == "ms" and c is not None:
            nz.st[node] = St("ms_eps", s.x, {"eps": c})
        elif s.kind == "qcos" and (r := _st(nz, y, "rotsin")) is not None and r.x is s.x:
            claim_rope(nz, node, s.x, s.p["tab"], r.p["tab"])
        elif s.kind == "scores" and s.p["mask"] is None and _float_tensor(y):
            nz.st[node] = St("scores", s.x, {**s.p, "mask": y})
        elif s.kind == "ccube" and resolve(nz, y) is s.x:
            nz.st[node] = St("inner", s.x)
        elif s.kind == "tanh" and c == 1.0:
            nz.st[node] = St("oneplus", s.x)
        else:
            continue
        return


def _mul(nz: Normalizer, node: fx.Node, op: Op) -> None:
    a, b = op.args[0], op.arg(1, "other")
    out = tensor(node)
    for x, y in ((a, b), (b, a)):
        s, c = nz.st.get(x) if isinstance(x, fx.Node) else None, scalar(y)
        tx = tensor(x)
        if c == 1.0 and tx is not None and out is not None and tx.dtype == out.dtype:
            _pass(nz, node, x)
        elif is_kiln(x, kiln_ops.act.default) and tensor(y) is not None:
            claim_gated(nz, node, x, resolve(nz, y))
        elif c == 0.5 and _float_tensor(x) and s is None:
            nz.st[node] = St("halfx", resolve(nz, x))
        elif s is None:
            continue
        elif s.kind == "inv_rms" and _f32_of(nz, y) is s.x:
            nz.st[node] = St("normed", s.x, s.p)
        elif s.kind in ("normed_cast", "normed") and tensor(y) is not None and tensor(y).dim() == 1:
            if s.kind == "normed" and tensor(s.x).dtype != torch.float32:
                continue
            claim_rms(nz, node, s, y)
        elif s.kind == "scores" and c is not None and s.p["mask"] is None:
            nz.st[node] = St("scores", s.x, {**s.p, "scale": s.p["scale"] * c})
        elif s.kind == "posf" and (ti := tensor(y)) is not None and ti.dim() == 1 and ti.dtype == torch.float32:
            nz.st[node] = St("freqs", s.x, {"inv": resolve(nz, y)})
        elif s.kind == "cos" and s.p.get("axis") and tensor(y) is not None and tensor(y).dim() == 4:
            nz.st[node] = St("qcos", resolve(nz, y), {"tab": s})
        elif s.kind == "sin" and s.p.get("axis") and (r := _st(nz, y, "rot")) is not None:
            nz.st[node] = St("rotsin", r.x, {"tab": s})
        elif s.kind == "cube" and c is not None and abs(c - 0.044715) < 1e-9:
            nz.st[node] = St("ccube", s.x)
        elif s.kind == "inner" and c is not None and abs(c - math.sqrt(2 / math.pi)) < 1e-6:
            nz.st[node] = St("garg", s.x)
        elif s.kind == "halfx" and (o := _st(nz, y, "oneplus")) is not None and o.x is s.x:
            claim_act(nz, node, s.x, "gelu_tanh")
        else:
            continue
        return


def _matmul(nz: Normalizer, node: fx.Node, op: Op) -> None:
    a, b = op.args[0], op.arg(1, "other")
    kt, probs = _st(nz, b, "kT"), _st(nz, a, "probs")
    ta = tensor(a)
    if kt is not None and ta is not None and ta.dim() == 4:
        nz.st[node] = St("scores", resolve(nz, a), {"k": kt.x, "scale": 1.0, "mask": None})
    elif probs is not None and tensor(b) is not None and tensor(b).dim() == 4:
        p = probs.p
        claim_attention(nz, node, probs.x, p["k"], resolve(nz, b), p["mask"], False, p["scale"], False)


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
