"""The formula rules of kiln.dynamo.rules: the arithmetic steps of HF's RMSNorm, rotary embedding, eager attention and
tanh-GELU, each setting the next state of its formula (see kiln.dynamo.rules) or, at its last step, claiming the kiln
op (rms_norm, rope, attention, gated and plain activations)."""

from __future__ import annotations

import math

import torch
from torch import fx

from kiln.dynamo.claims import claim_act, claim_attention, claim_gated, claim_rms, claim_rope
from kiln.dynamo.fx_query import Op, is_kiln, scalar, tensor
from kiln.dynamo.normalize import Normalizer, St, kiln_ops, resolve
from kiln.dynamo.rules_common import _dim, _f32_of, _float_tensor, _pass, _st


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
