"""flash_tiling: kiln::attention becomes kiln::flash_attention with a concrete tile config.

Matches: every kiln::attention node (q, k, v flat [B, T, heads * head_dim], GQA by head counts).
Emits: kiln::flash_attention(q, k, v, H, Hkv, causal, window, scale, block_m, block_n, num_warps, num_stages),
the tile also kept in node.meta["tile"] for dumps. The tile comes from codegen's default_tile(head_dim, dtype,
capability): on CPU (capability None) the small interpreter-friendly config. On a CUDA device with autotuning
on (KILN_AUTOTUNE, default 1), a small candidate set is timed on random inputs of the node's shape and the
winner is cached on disk (KILN_CACHE_DIR/../autotune/flash_attention.json) per device and problem shape.
The autotune path is written against the codegen API but has not run on a GPU in this repository's tests.
A spec's `attention = flash(block_m = ..., block_n = ..., warps = ..., stages = ...)` pins one tile for every
node instead (make_pass(tile); build_pipeline binds it from CompileConfig.extra["attention"]).
Requires: node.meta["val"] on the attention inputs (the pipeline refreshes it after every pass); best after
gqa_fusion and rope_fusion so it sees their outputs, but it does not depend on them.
"""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path

import torch
from torch import fx

from kiln import env
from kiln.codegen.cache import default_cache_dir
from kiln.codegen.flash_attn import flash_attention
from kiln.codegen.tiles import TileConfig, default_tile
from kiln.passes._graph import rename
from kiln.passes.base import Pass, PassResult

kiln_ops = torch.ops.kiln


def _capability(device: torch.device) -> tuple[int, int] | None:
    if device.type == "cuda":
        return torch.cuda.get_device_capability(device)
    if device.type == "meta" and torch.cuda.is_available():  # a meta build targets the local GPU
        return torch.cuda.get_device_capability()
    return None


def _autotune_enabled() -> bool:
    return torch.cuda.is_available() and env.autotune()


def _autotune_file() -> Path:
    return default_cache_dir().parent / "autotune" / "flash_attention.json"


def _autotune(q: torch.Tensor, k: torch.Tensor, args: tuple, head_dim: int, default):  # pragma: no cover (GPU)
    """The fastest of a few tile configs for this problem on the current GPU, cached on disk by problem key."""
    import triton.testing

    num_heads, num_kv_heads, causal, window, scale = args
    cap = torch.cuda.get_device_capability()
    key = (f"{torch.cuda.get_device_name()}|sm{cap[0]}{cap[1]}|{q.dtype}|d{head_dim}|h{num_heads}/{num_kv_heads}"
           f"|causal{int(causal)}|window{int(window > 0)}|t{triton.next_power_of_2(q.shape[1])}")
    path = _autotune_file()
    table = json.loads(path.read_text()) if path.is_file() else {}
    if key in table:
        return TileConfig(**table[key])
    b, t, s = q.shape[0], q.shape[1], k.shape[1]
    qr = torch.randn(b, t, num_heads * head_dim, dtype=q.dtype, device="cuda")
    kr = torch.randn(b, s, num_kv_heads * head_dim, dtype=q.dtype, device="cuda")
    vr = torch.randn_like(kr)
    candidates = {default}
    for bm in (64, 128):
        for bn in (32, 64, 128):
            if bn * head_dim <= 128 * 128:
                candidates.add(TileConfig(bm, bn, 4 if bm * bn <= 64 * 64 else 8, 2 if head_dim > 64 else 3))
    timings = {}
    for tile in candidates:
        call = lambda tile=tile: flash_attention(qr, kr, vr, num_heads, num_kv_heads, causal, window, scale, tile=tile)
        try:
            timings[tile] = triton.testing.do_bench(call, warmup=5, rep=20)
        except Exception:  # a config the device cannot run (shared memory) simply loses
            continue
    best = min(timings, key=timings.__getitem__) if timings else default
    table[key] = {f: getattr(best, f) for f in ("block_m", "block_n", "num_warps", "num_stages")}
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, suffix=".tmp")
    with os.fdopen(fd, "w") as f:
        json.dump(table, f, indent=1, sort_keys=True)
    os.replace(tmp, path)
    return best


def choose_tile(q: torch.Tensor, k: torch.Tensor, args: tuple, head_dim: int):
    """The tile config for one attention call described by fake/meta tensors q and k and (H, Hkv, causal, window,
    scale)."""

    default = default_tile(head_dim, q.dtype, _capability(q.device))
    if _autotune_enabled() and q.device.type == "cuda":
        return _autotune(q, k, args, head_dim, default)
    return default


def run(gm: fx.GraphModule, fixed=None) -> PassResult:
    """Tile every kiln::attention node: with `fixed` (a TileConfig) when given, else choose_tile per shape."""
    graph = gm.graph
    nodes = [n for n in graph.nodes if n.op == "call_function" and n.target == kiln_ops.attention.default]
    for node in nodes:
        q, k, v, num_heads, num_kv_heads, causal, window, scale = node.args
        q_val, k_val = q.meta["val"], k.meta["val"]
        head_dim = q_val.shape[-1] // num_heads
        tile = fixed or choose_tile(q_val, k_val, (num_heads, num_kv_heads, causal, window, scale), head_dim)
        with graph.inserting_before(node):
            new = graph.create_node(
                "call_function",
                kiln_ops.flash_attention.default,
                (*node.args, tile.block_m, tile.block_n, tile.num_warps, tile.num_stages),
            )
        new.meta["tile"] = {"block_m": tile.block_m, "block_n": tile.block_n,
                            "num_warps": tile.num_warps, "num_stages": tile.num_stages}
        node.replace_all_uses_with(new)
        old_name = node.name
        graph.erase_node(node)
        rename(new, old_name)
    return PassResult(gm, modified=bool(nodes))


def make_pass(tile=None) -> Pass:
    """The pass with one fixed tile (a TileConfig or its fields as a dict) for every node; None: choose per shape."""
    if tile is None:
        return PASS

    fixed = (TileConfig(**tile) if isinstance(tile, dict) else tile).validate()
    return Pass(name="flash_tiling", run=lambda gm: run(gm, fixed), doc=__doc__ or "")


PASS = Pass(name="flash_tiling", run=run, doc=__doc__ or "")
