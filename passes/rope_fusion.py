"""rope_fusion: the two rotary embeddings of an attention site become one over the q|k slab.

Matches (after gqa_fusion): aten.split_with_sizes(qkv, [q, k, v], -1) whose pieces 0 and 1 each feed exactly
one kiln::rope, both with the same positions and inv_freq. Rope acts per head and q and k share head_dim,
so rotating the adjacent q|k columns of the fused projection at once equals rotating q and k separately.
Emits: the split becomes split_with_sizes(qkv, [q + k, v], -1); one kiln::rope on piece 0 (a strided view,
which the rope kernel takes as is), then split_with_sizes(rotated, [q, k], -1) whose pieces replace the two
ropes; v's getitem moves to index 1. One kernel launch instead of two per layer.
A site with a q/k norm (kiln::head_rms_norm between the split and each rope, Qwen3) does not match: its ropes
read two separate normed tensors, not adjacent columns of the projection.
Requires: gqa_fusion (without it q and k are separate tensors and nothing matches).
"""

from __future__ import annotations

import operator

import torch
from torch import fx

from kiln.passes._graph import is_call, rename
from kiln.passes.base import Pass, PassResult

kiln_ops = torch.ops.kiln
_SPLIT = torch.ops.aten.split_with_sizes.default


def _pieces(split: fx.Node) -> dict[int, fx.Node] | None:
    """index -> the single getitem reading it, or None if any reader is not a plain getitem."""
    out: dict[int, fx.Node] = {}
    for u in split.users:
        if not is_call(u, operator.getitem) or u.args[1] in out:
            return None
        out[u.args[1]] = u
    return out


def _match(split: fx.Node) -> tuple[fx.Node, fx.Node, dict[int, fx.Node]] | None:
    if len(split.args) < 3 or split.args[2] != -1 or len(split.args[1]) != 3:
        return None
    pieces = _pieces(split)
    if pieces is None or 0 not in pieces or 1 not in pieces:
        return None
    ropes = []
    for i in (0, 1):
        users = list(pieces[i].users)
        if len(users) != 1 or not is_call(users[0], kiln_ops.rope.default) or users[0].args[0] is not pieces[i]:
            return None
        ropes.append(users[0])
    q_rope, k_rope = ropes
    if q_rope.args[1:] != k_rope.args[1:]:
        return None
    return q_rope, k_rope, pieces


def _fuse(gm: fx.GraphModule, split: fx.Node, q_rope: fx.Node, k_rope: fx.Node, pieces: dict[int, fx.Node]) -> None:
    graph = gm.graph
    q_size, k_size, v_size = split.args[1]
    split.args = (split.args[0], [q_size + k_size, v_size], -1)
    if 2 in pieces:
        pieces[2].args = (split, 1)
    qk = pieces[0]
    order = {n: i for i, n in enumerate(graph.nodes)}
    first = min(q_rope, k_rope, key=order.__getitem__)  # positions/inv_freq are defined before both ropes
    name = str(split.name).removesuffix("_split")
    with graph.inserting_before(first):
        rot = graph.create_node("call_function", kiln_ops.rope.default, (qk, *q_rope.args[1:]), name=f"{name}_qk_rope")
        rot_split = graph.create_node("call_function", _SPLIT, (rot, [q_size, k_size], -1), name=f"{name}_qk_split")
        new_q = graph.create_node("call_function", operator.getitem, (rot_split, 0))
        new_k = graph.create_node("call_function", operator.getitem, (rot_split, 1))
    names = [q_rope.name, k_rope.name]
    q_rope.replace_all_uses_with(new_q)
    k_rope.replace_all_uses_with(new_k)
    for old in (q_rope, k_rope, pieces[1]):
        graph.erase_node(old)
    rename(qk, f"{name}_qk")
    rename(new_q, names[0])
    rename(new_k, names[1])


def run(gm: fx.GraphModule) -> PassResult:
    matches = []
    for node in gm.graph.nodes:
        if is_call(node, _SPLIT):
            m = _match(node)
            if m is not None:
                matches.append((node, *m))
    for split, q_rope, k_rope, pieces in matches:
        _fuse(gm, split, q_rope, k_rope, pieces)
    return PassResult(gm, modified=bool(matches))


PASS = Pass(name="rope_fusion", run=run, requires=("gqa_fusion",), doc=__doc__ or "")
