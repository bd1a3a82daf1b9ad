"""flash_tiling: kiln::attention becomes kiln::flash_attention with a concrete tile config.

Matches: every kiln::attention node (q, k, v flat [B, T, heads * head_dim], GQA by head counts).
Emits: kiln::flash_attention(q, k, v, H, Hkv, causal, window, scale, block_m, block_n, num_warps, num_stages),
the tile also kept in node.meta["tile"] for dumps. Where it can tune (codegen.autotune.tuning_device: a CUDA
graph, a meta graph on a machine with a GPU, or the interpreter with an injected timer; KILN_AUTOTUNE=0
turns it off) the tile is the fastest of codegen.tiles.candidate_tiles for the node's (head dim, dtype, GPU
capability, causal, window) on random inputs of a fixed tuning shape (tuning_shape), cached on disk per
device, triton version and template source, so a later process loads it and times nothing. Elsewhere it is
codegen's default_tile(head_dim, dtype, capability): on CPU the small interpreter-friendly config.
A spec's `attention = flash(block_m = ..., block_n = ..., warps = ..., stages = ...)` pins one tile for every
node instead (make_pass(tile); build_pipeline binds it from CompileConfig.extra["attention"]).
Requires: node.meta["val"] on the attention inputs (the pipeline refreshes it after every pass); best after
gqa_fusion and rope_fusion so it sees their outputs, but it does not depend on them.
"""

from __future__ import annotations

import torch
from torch import fx

from kiln.codegen import autotune
from kiln.codegen.flash_attn import flash_attention
from kiln.codegen.paged_tiles import flash_problem, prefill_tile
from kiln.codegen.tiles import TileConfig, candidate_tiles, default_tile
from kiln.passes._graph import rename
from kiln.passes.base import Pass, PassResult

kiln_ops = torch.ops.kiln

TUNE_SEQ_CUDA = 4096  # long enough that the key loop, not the launch, is what the timer sees
TUNE_SEQ_INTERPRETER = 40  # a few interpreter tiles per candidate: the tests' tuning stays quick


def _capability(device: torch.device) -> tuple[int, int] | None:
    if device.type == "cuda":
        return torch.cuda.get_device_capability(device)
    if device.type == "meta" and torch.cuda.is_available():  # a meta build targets the local GPU
        return torch.cuda.get_device_capability()
    return None


def tuning_shape(num_heads: int, device: torch.device) -> tuple[int, int]:
    """(batch, seq) of the tuning inputs: on CUDA enough query blocks to fill the GPU several times over."""
    if device.type == "cuda":
        return max(1, 128 // num_heads), TUNE_SEQ_CUDA
    return 1, TUNE_SEQ_INTERPRETER


def tuned_tile(device: torch.device, dtype: torch.dtype, head_dim: int, num_heads: int, num_kv_heads: int,
               causal: bool, window: int, scale: float) -> TileConfig:
    """The fastest candidate tile for flash attention with these parameters on `device` (a tuning device, see
    codegen.autotune.tuning_device): loaded from the tuning cache, or timed now on tuning_shape inputs."""
    capability = torch.cuda.get_device_capability(device) if device.type == "cuda" else None
    problem = flash_problem(dtype, head_dim, causal, window > 0, capability)
    candidates = candidate_tiles(head_dim, dtype, capability)
    found = autotune.lookup("flash_attn", device, problem, candidates)
    if found is not None:
        return found
    b, t = tuning_shape(num_heads, device)
    g = torch.Generator(device=device).manual_seed(0)
    q = torch.randn(b, t, num_heads * head_dim, generator=g, device=device).to(dtype)
    k = torch.randn(b, t, num_kv_heads * head_dim, generator=g, device=device).to(dtype)
    v = torch.randn(b, t, num_kv_heads * head_dim, generator=g, device=device).to(dtype)
    out = torch.empty_like(q)

    def make_call(tile: TileConfig):
        return lambda: flash_attention(q, k, v, num_heads, num_kv_heads, causal, window, scale, tile, out=out)

    best = autotune.tune("flash_attn", device, problem, candidates, make_call)
    prefill_tile.cache_clear()  # the paged prefill reads flash's tuned tile (the one tuned without TMA loads)
    return best


def choose_tile(q: torch.Tensor, k: torch.Tensor, args: tuple, head_dim: int) -> TileConfig:
    """The tile config for one attention call described by fake/meta tensors q and k and (H, Hkv, causal, window,
    scale): tuned (or loaded from the tuning cache) where tuning_device allows, else the heuristic default."""
    device = autotune.tuning_device(q.device)
    if device is not None:
        return tuned_tile(device, q.dtype, head_dim, *args)
    return default_tile(head_dim, q.dtype, _capability(q.device))


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
