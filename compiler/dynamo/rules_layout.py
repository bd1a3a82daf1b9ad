"""The layout rules of kiln.dynamo.rules: views, copies, casts, indexing and concatenation. They pass a state on
(same) or set the states of views and indexing (heads, kT, unsq2, rep_exp, rep, half0, half1, posu), of casts (f32,
posf, normed_cast, the rotary tables' dtype) and of the concatenations in rotary tables and rotate_half (emb, rot),
which the formula rules (rules_formulas.py) read; kiln.dynamo.rules says what each state means."""

from __future__ import annotations

import torch
from torch import fx

from kiln.dynamo.fx_query import Op, same, same_shape, tensor
from kiln.dynamo.normalize import Normalizer, St, resolve
from kiln.dynamo.rules_common import _FLOATS, _dim, _pass, _st

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
