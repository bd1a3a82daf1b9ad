"""Claims of kiln.dynamo.normalize: the checks that a matched pattern fits its kiln kernel, then the rewrite.

Every check that fails records a Rejection naming the reason and leaves the torch nodes alone, so a claim is
only ever made when the kernel computes the same value for these shapes and dtypes.
"""

from __future__ import annotations

import torch
from torch import fx

from kiln.dynamo.fx_query import canon, equal_guarded, same, same_shape, scalar, tensor
from kiln.dynamo.normalize import Normalizer, St, kiln_ops, resolve

_FLOATS = (torch.float32, torch.float16, torch.bfloat16)
CLAIMABLE = ("attention", "rms_norm", "layer_norm", "rope", "gated_act", "act", "linear", "add")
_MAX_HEAD_DIM = 256  # the flash kernel's limit


def _static(*dims: object) -> bool:
    return all(isinstance(d, int) for d in dims)


def kiln_add(nz: Normalizer, x: fx.Node) -> fx.Node:
    """x itself, or kiln::add in its place when x is a plain same-shape add (a residual), so that norm_fusion
    can fuse it with the norm that reads it."""
    op = canon(x)
    if op is None or op.name != "add" or op.kwargs or len(op.args) != 2:
        return x
    a, b = op.args
    ta, tb, tx = tensor(a), tensor(b), tensor(x)
    if ta is None or tb is None or tx is None or ta.dtype not in _FLOATS or not (ta.dtype == tb.dtype == tx.dtype):
        return x
    if not (same_shape(ta.shape, tb.shape) and same_shape(ta.shape, tx.shape)):
        return x
    return nz.claim(x, "add", (a, b))


def claim_rms(nz: Normalizer, node: fx.Node, s: St, w: fx.Node) -> None:
    x, tx, tw, out = s.x, tensor(s.x), tensor(w), tensor(node)
    if tx is None or tx.dtype not in _FLOATS or tx.dim() < 2:
        return nz.reject(node, "rms_norm", "input is not a float tensor of rank >= 2")
    if not same(tw.shape[0], tx.shape[-1]):
        return nz.reject(node, "rms_norm", f"weight has {tw.shape[0]} features, input {tx.shape[-1]}")
    if tw.dtype != tx.dtype or out.dtype != tx.dtype:
        return nz.reject(node, "rms_norm", f"weight dtype {tw.dtype} differs from input {tx.dtype} (torch promotes)")
    nz.claim(node, "rms_norm", (kiln_add(nz, x), w, s.p["eps"]), detail=f"eps={s.p['eps']:g}")


def claim_layer_norm(
    nz: Normalizer, node: fx.Node, x: fx.Node, shape: object, w: object, b: object, eps: object
) -> None:
    tx = tensor(x)
    if tx is None or tx.dtype not in _FLOATS or tx.dim() < 2:
        return nz.reject(node, "layer_norm", "input is not a float tensor of rank >= 2")
    if not (isinstance(shape, (list, tuple)) and len(shape) == 1 and same(shape[0], tx.shape[-1])):
        return nz.reject(node, "layer_norm", f"normalized_shape {shape} is not the last dim")
    for name, p in (("weight", w), ("bias", b)):
        tp = tensor(p)
        if tp is None or tp.dim() != 1 or tp.dtype != tx.dtype:
            return nz.reject(node, "layer_norm", f"{name} is missing or not a 1-D {tx.dtype} tensor")
    value = scalar(eps)  # under dynamic=True a float input, specialized with a guard as RMSNorm's eps
    if value is None:
        return nz.reject(node, "layer_norm", "eps is not a constant")
    nz.claim(node, "layer_norm", (kiln_add(nz, x), w, b, value), detail=f"eps={value:g}")


def claim_linear(nz: Normalizer, node: fx.Node, x: fx.Node, w: object, b: object) -> None:
    tx, tw, tb = tensor(x), tensor(w), tensor(b)
    if tx is None or tw is None or tx.dtype not in _FLOATS or tw.dim() != 2 or tw.dtype != tx.dtype:
        return nz.reject(node, "linear", "input / weight are not float tensors of one dtype with a 2-D weight")
    if b is not None and (tb is None or tb.dim() != 1 or tb.dtype != tx.dtype):
        return nz.reject(node, "linear", "bias is not a 1-D tensor of the input dtype")
    nz.claim(node, "linear", (x, w, b))


def claim_act(nz: Normalizer, node: fx.Node, x: fx.Node, kind: str) -> None:
    tx, out = tensor(x), tensor(node)
    if tx is None or tx.dtype not in _FLOATS or out is None or out.dtype != tx.dtype:
        return nz.reject(node, "act", f"{kind} input is not a float tensor")
    nz.claim(node, "act", (x, kind), detail=kind)


def claim_gated(nz: Normalizer, node: fx.Node, act: fx.Node, up: fx.Node) -> None:
    gate, kind = act.args
    tg, tu = tensor(gate), tensor(up)
    if not same_shape(tg.shape, tu.shape) or tg.dtype != tu.dtype:
        return nz.reject(node, "gated_act", "act(gate) * up with different shapes or dtypes (a broadcast)")
    nz.claim(node, "gated_act", (gate, up, kind), detail=kind)


def claim_rope(nz: Normalizer, node: fx.Node, q: fx.Node, cos: St, sin: St) -> None:
    if (cos.x, cos.p["inv"], cos.p["dtype"], cos.p["axis"]) != (sin.x, sin.p["inv"], sin.p["dtype"], sin.p["axis"]):
        return nz.reject(node, "rope", "cos and sin come from different positions / frequencies")
    tq, tpos, tinv = tensor(q), tensor(cos.x), tensor(cos.p["inv"])
    form = "bhtd" if cos.p["axis"] == 1 else "bthd"
    b, t = tq.shape[0], tq.shape[2 if form == "bhtd" else 1]
    h, d = tq.shape[1 if form == "bhtd" else 2], tq.shape[3]
    if tq.dtype not in _FLOATS or cos.p["dtype"] != tq.dtype:
        return nz.reject(node, "rope", f"tables in {cos.p['dtype']} but q in {tq.dtype} (torch promotes)")
    if not _static(h, d, tinv.shape[0]) or d != 2 * tinv.shape[0]:
        return nz.reject(node, "rope", f"head_dim {d} is not static or not 2 * len(inv_freq) = {2 * tinv.shape[0]}")
    if tpos.dim() != 2 or not same(tpos.shape[1], t) or not (same(tpos.shape[0], b) or same(tpos.shape[0], 1)):
        return nz.reject(node, "rope", f"positions {tuple(tpos.shape)} are not [B or 1, T] for q {tuple(tq.shape)}")
    flat = nz.flat(q, form, node)
    pos = cos.x
    if not same(tpos.shape[0], b):  # position ids shared by the batch: [1, T] -> [B, T] (a view)
        key = ("expand_positions", pos, str(b))  # str: a symbolic batch size (SymInt) is not hashable
        # One node per positions tensor, so rope_fusion sees q and k share it (a new one after a write to it).
        memo = nz.memo.get(key)
        if memo is None or any(nz.pos[memo] < w < nz.pos[node] for w in nz.written.get(pos, ())):
            nb = b if isinstance(b, int) else nz.emit(node, torch.ops.aten.sym_size.int, (flat, 0))
            nz.memo[key] = nz.emit(node, "expand", (pos, nb, -1), method=True)
        pos = nz.memo[key]
    nz.claim(node, "rope", (flat, pos, cos.p["inv"]), layout=(form, h, d), detail=f"H={h} D={d}")


def _kv(nz: Normalizer, n: fx.Node) -> tuple[fx.Node, int]:
    """(the [B, Hkv, S, D] tensor, repeat factor) of an attention key/value input (repeat_kv undone)."""
    s = nz.st.get(n)
    if s is not None and s.kind == "rep":
        return resolve(nz, s.x), s.p["rep"]
    return n, 1


def _mask(nz: Normalizer, node: fx.Node, mask: fx.Node, t: object, s: object) -> tuple[bool, int] | str:
    tm = tensor(mask)
    if tm is None or tm.dim() < 2 or not (same(tm.shape[-2], t) and same(tm.shape[-1], s)):
        return "the mask is not provably [.., T, S] for these q / k"
    if nz.mask_spec is None:
        return "a mask tensor, and no way to check its values"
    spec = nz.mask_spec(mask)
    if isinstance(spec, str):
        return spec
    nz.masks[mask.name] = spec
    return spec


def claim_attention(
    nz: Normalizer,
    node: fx.Node,
    q: fx.Node,
    k: fx.Node,
    v: fx.Node,
    mask: object,
    is_causal: bool,
    scale: float,
    enable_gqa: bool,
) -> None:
    if "attention" in nz.off:  # before the mask is read: a mask of an attention not claimed needs no check
        return nz.reject(node, "attention", "claims of attention are switched off (option claims)")
    (kb, krep), (vb, vrep) = _kv(nz, k), _kv(nz, v)
    tq, tk, tv = tensor(q), tensor(kb), tensor(vb)
    if tk is None or tv is None or tk.dim() != 4 or tv.dim() != 4:
        return nz.reject(node, "attention", "k / v are not 4-D [B, Hkv, S, D] tensors")
    b, h, t, d = tq.shape
    hkv, slen = tk.shape[1], tk.shape[2]
    if not _static(h, d, hkv, tv.shape[1], tv.shape[3]) or not 1 <= d <= _MAX_HEAD_DIM:
        return nz.reject(node, "attention", f"head count / head_dim not static or head_dim {d} > {_MAX_HEAD_DIM}")
    if tv.shape[1] != hkv or krep != vrep or tk.shape[3] != d or tv.shape[3] != d:
        return nz.reject(node, "attention", "k and v differ in heads, repeat or head_dim from q")
    # Guarded, not only provable: in a decode graph the cached keys and values are separate inputs with their
    # own length symbols (and batch symbols once the batch size changed), equal in every call sdpa accepts.
    if not (equal_guarded(tk.shape[0], b) and equal_guarded(tv.shape[0], b) and equal_guarded(tv.shape[2], slen)):
        shapes = f"q {tuple(tq.shape)}, k {tuple(tk.shape)}, v {tuple(tv.shape)}"
        return nz.reject(node, "attention", f"q, k, v batch / key lengths differ ({shapes}; a broadcast?)")
    if hkv * krep != h and not (enable_gqa and krep == 1 and h % hkv == 0):
        return nz.reject(node, "attention", f"{h} query heads do not match {hkv} kv heads x {krep}")
    if tq.dtype not in _FLOATS or not (tq.dtype == tk.dtype == tv.dtype):
        return nz.reject(node, "attention", f"q / k / v dtypes {tq.dtype}, {tk.dtype}, {tv.dtype}")
    if mask is not None and is_causal:
        return nz.reject(node, "attention", "both attn_mask and is_causal")
    if mask is None:
        if is_causal and not same(t, slen):  # sdpa aligns is_causal top-left; kiln aligns queries to the end
            return nz.reject(node, "attention", "is_causal with query length not provably equal to key length")
        causal, window = bool(is_causal), 0
    else:
        spec = _mask(nz, node, mask, t, slen)
        if isinstance(spec, str):
            return nz.reject(node, "attention", spec)
        causal, window = spec
    qf, kf, vf = nz.flat(q, "bhtd", node), nz.flat(kb, "bhtd", node), nz.flat(vb, "bhtd", node)
    detail = f"H={h} Hkv={hkv} D={d} causal={causal} window={window}" + (" (mask checked per call)" if mask else "")
    nz.claim(node, "attention", (qf, kf, vf, h, hkv, causal, window, scale), layout=("bhtd", h, d), detail=detail)


__all__ = [
    "claim_act",
    "claim_attention",
    "claim_gated",
    "claim_layer_norm",
    "claim_linear",
    "claim_rms",
    "claim_rope",
    "kiln_add",
    "kiln_ops",
]
