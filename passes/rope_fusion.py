"""rope_fusion: the two rotary embeddings of an attention site become one over the q|k slab.

Matches (after gqa_fusion): aten.split_with_sizes(qkv, [q, k, v], -1) whose pieces 0 and 1 each feed exactly
one kiln::rope, both with the same positions and inv_freq. Rope acts per head and q and k share head_dim,
so rotating the adjacent q|k columns of the fused projection at once equals rotating q and k separately.
A site with a q/k norm (Qwen3) matches too: there each piece feeds exactly one kiln::head_rms_norm whose only
reader is its rope, both norms with the same eps and weights of head_dim features (node.meta["val"]), so the
norms act on the same heads as the ropes.
Emits: the split becomes split_with_sizes(qkv, [q + k, v], -1); on piece 0 (a strided view, which the kernel
takes as is) one kiln::rope, or at a q/k-normed site one kiln::qk_norm_rope(qk, q_weight, k_weight, q, eps,
positions, inv_freq) (both norms and both ropes: one launch of the rope kernel with its norm on), then
split_with_sizes(result, [q, k], -1) whose pieces replace the two ropes; v's getitem moves to index 1. One
kernel launch instead of two per layer (four at a q/k-normed site).
Requires: gqa_fusion (without it q and k are separate tensors and nothing matches).
"""

from __future__ import annotations

import operator
from dataclasses import dataclass

import torch
from torch import fx

import kiln.ir.ops_level2  # noqa: F401  (registers kiln::qk_norm_rope, which this pass emits)
from kiln.ir.signatures import QK_NORM_ROPE
from kiln.passes._graph import hoist_before, is_call, rename
from kiln.passes.base import Pass, PassResult

kiln_ops = torch.ops.kiln
_SPLIT = torch.ops.aten.split_with_sizes.default


@dataclass
class _Site:
    split: fx.Node
    pieces: dict[int, fx.Node]  # index -> the getitem reading it
    ropes: tuple[fx.Node, fx.Node]  # q's, k's
    norms: tuple[fx.Node, fx.Node] | None  # q's and k's head_rms_norm, at a q/k-normed site


def _pieces(split: fx.Node) -> dict[int, fx.Node] | None:
    """index -> the single getitem reading it, or None if any reader is not a plain getitem."""
    out: dict[int, fx.Node] = {}
    for u in split.users:
        if not is_call(u, operator.getitem) or u.args[1] in out:
            return None
        out[u.args[1]] = u
    return out


def _sole_reader(node: fx.Node, target: object) -> fx.Node | None:
    """node's only user, if it calls `target` on node (as its first argument)."""
    users = list(node.users)
    if len(users) == 1 and is_call(users[0], target) and users[0].args[0] is node:
        return users[0]
    return None


def _features(node: object) -> int | None:
    """The length of a 1-d tensor argument (from node.meta["val"]), else None."""
    val = node.meta.get("val") if isinstance(node, fx.Node) else None
    return val.shape[0] if isinstance(val, torch.Tensor) and val.dim() == 1 else None


def _same_heads(norms: tuple[fx.Node, fx.Node], rope: fx.Node) -> bool:
    """Both norms have one eps and weights of the ropes' head_dim (2 * len(inv_freq))."""
    q_norm, k_norm = norms
    if q_norm.args[2:] != k_norm.args[2:] or q_norm.kwargs or k_norm.kwargs:
        return False
    half = _features(rope.args[2])
    return half is not None and _features(q_norm.args[1]) == _features(k_norm.args[1]) == 2 * half


def _match(split: fx.Node) -> _Site | None:
    if len(split.args) < 3 or split.args[2] != -1 or len(split.args[1]) != 3:
        return None
    pieces = _pieces(split)
    if pieces is None or 0 not in pieces or 1 not in pieces:
        return None
    ropes, norms = [], []
    for i in (0, 1):
        norm = _sole_reader(pieces[i], kiln_ops.head_rms_norm.default)
        rope = _sole_reader(norm if norm is not None else pieces[i], kiln_ops.rope.default)
        if rope is None:
            return None
        ropes.append(rope)
        norms.append(norm)
    q_rope, k_rope = ropes
    if q_rope.args[1:] != k_rope.args[1:] or q_rope.kwargs or k_rope.kwargs:
        return None
    if norms == [None, None]:
        return _Site(split, pieces, (q_rope, k_rope), None)
    if None in norms or not _same_heads((norms[0], norms[1]), q_rope):
        return None
    return _Site(split, pieces, (q_rope, k_rope), (norms[0], norms[1]))


def _fuse(gm: fx.GraphModule, site: _Site) -> None:
    graph, split, pieces = gm.graph, site.split, site.pieces
    q_rope, k_rope = site.ropes
    q_size, k_size, v_size = split.args[1]
    split.args = (split.args[0], [q_size + k_size, v_size], -1)
    if 2 in pieces:
        pieces[2].args = (split, 1)
    qk = pieces[0]
    positions, inv_freq = q_rope.args[1:]
    order = {n: i for i, n in enumerate(graph.nodes)}
    first = min(q_rope, k_rope, key=order.__getitem__)  # positions/inv_freq are defined before both ropes
    name = str(split.name).removesuffix("_split")
    if site.norms is None:
        target, args, suffix = kiln_ops.rope.default, (qk, positions, inv_freq), "qk_rope"
    else:
        q_norm, k_norm = site.norms
        q_weight, k_weight, eps = q_norm.args[1], k_norm.args[1], q_norm.args[2]
        hoist_before(first, [q_weight, k_weight])  # k's weight may be read first after q's rope
        values = dict(qk=qk, q_weight=q_weight, k_weight=k_weight, q_features=q_size, eps=eps, positions=positions,
                      inv_freq=inv_freq)  # fmt: skip
        target, args, suffix = kiln_ops.qk_norm_rope.default, QK_NORM_ROPE.values(values), "qk_norm_rope"
    with graph.inserting_before(first):
        rot = graph.create_node("call_function", target, args, name=f"{name}_{suffix}")
        rot_split = graph.create_node("call_function", _SPLIT, (rot, [q_size, k_size], -1), name=f"{name}_qk_split")
        new_q = graph.create_node("call_function", operator.getitem, (rot_split, 0))
        new_k = graph.create_node("call_function", operator.getitem, (rot_split, 1))
    names = [q_rope.name, k_rope.name]
    q_rope.replace_all_uses_with(new_q)
    k_rope.replace_all_uses_with(new_k)
    for old in (q_rope, k_rope, *(site.norms or ()), pieces[1]):
        graph.erase_node(old)
    rename(qk, f"{name}_qk")
    rename(new_q, names[0])
    rename(new_k, names[1])


def run(gm: fx.GraphModule) -> PassResult:
    sites = [site for node in gm.graph.nodes if is_call(node, _SPLIT) and (site := _match(node)) is not None]
    for site in sites:
        _fuse(gm, site)
    return PassResult(gm, modified=bool(sites))


PASS = Pass(name="rope_fusion", run=run, requires=("gqa_fusion",), doc=__doc__ or "")
