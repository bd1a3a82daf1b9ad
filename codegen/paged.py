"""Host wrappers for the paged-KV-cache kernels: the cache write, split-KV decode (+ merge) and paged prefill.

`paged_attention` has the signature of kiln::paged_attention (kiln.ir.ops_paged): it writes the step's K/V
(templates/paged_kv_write.py.j2), then runs the decode kernels when every sequence has one new query
(max_query_len == 1: templates/paged_decode.py.j2 per split, templates/paged_merge.py.j2 to combine) and the
prefill kernel otherwise (templates/paged_prefill.py.j2). Nothing here reads device values back to the host:
grids come from the host-side bounds max_query_len and max_context_len, which must bound the batch. Work
inside a grid is bounded by the context lengths the kernels read on the device (a decode split's length is
per sequence), so a loose bound (a CUDA graph's max_model_len) adds empty programs, not work.
Rows of q past query_start_loc[S] belong to no sequence (a routed layer's compact batch pads its routed rows to a
static count; kiln.ir.ops_mod_step): their output is zeros, as in the reference, written by the merge (decode) or
by one extra sequence slot of the prefill grid, so the layer body after attention never reads unwritten memory.
Cache layout: [layers, 2, num_blocks, block_size, kv_heads, head_dim] (kiln.step). An int8 cache comes
with kv_scales fp32 [layers, 2, num_blocks, block_size, kv_heads]: the write kernel quantizes each token's head
rows (kiln.ir.ops_paged.quantize_kv), the attention kernels multiply the int8 K/V tiles' scales back in (QK^T
columns by the K scales, the probabilities by the V scales) and accumulate in fp32 as for a float cache.
"""

from __future__ import annotations

import torch

from kiln.codegen._host import (
    FLOAT_DTYPES,
    cdiv,
    check_out,
    check_same_device,
    check_tensor,
    dot_consts,
    launch,
    next_power_of_2,
)
from kiln.codegen.flash_attn import checked_tile
from kiln.codegen.paged_tiles import MIN_SPLIT_KEYS, decode_splits, decode_tile, prefill_tile
from kiln.codegen.tiles import TileConfig
from kiln.errors import CodegenError

_INDEX = (torch.int32, torch.int64)


def _rows(t: torch.Tensor, name: str) -> torch.Tensor:
    """[N, F] or [1, N, F] -> a [N, F] view with a unit last stride."""
    check_tensor(t, name)
    if t.dim() == 3 and t.shape[0] == 1:
        t = t[0]
    if t.dim() != 2:
        raise CodegenError(f"{name} must be [N, features] or [1, N, features], got shape {tuple(t.shape)}")
    return t


def _check_cache(kv_cache: torch.Tensor, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The layer's k and v caches [num_blocks, block_size, kv_heads, head_dim] (views).

    The scales of an int8 cache are checked by _scale_args."""
    check_tensor(kv_cache, "kv_cache", ndim=6, dtypes=(*FLOAT_DTYPES, torch.int8))
    if kv_cache.shape[1] != 2:
        raise CodegenError(
            f"kv_cache must be [layers, 2, blocks, block_size, kv_heads, head_dim], got {tuple(kv_cache.shape)}"
        )
    if not 0 <= layer < kv_cache.shape[0]:
        raise CodegenError(f"layer {layer} is outside kv_cache's {kv_cache.shape[0]} layers")
    if kv_cache.stride(-2) != kv_cache.shape[-1]:
        raise CodegenError(f"kv_cache must have contiguous [kv_heads, head_dim] rows, strides {kv_cache.stride()}")
    return kv_cache[layer, 0], kv_cache[layer, 1]


def _cache_args(k_cache: torch.Tensor, v_cache: torch.Tensor) -> dict:
    """The kernels' cache arguments: the layer's k / v caches and their block / offset / head strides (shared)."""
    stride_cb, stride_co, stride_ch = k_cache.stride()[:3]
    return dict(k_cache_ptr=k_cache, v_cache_ptr=v_cache, stride_cb=stride_cb, stride_co=stride_co, stride_ch=stride_ch)


def _scale_args(kv_cache: torch.Tensor, layer: int, kv_scales: torch.Tensor | None) -> dict:
    """The kernels' scale arguments: k / v scale pointers and their block / offset / head strides; for a float
    cache the cache itself stands in as a pointer the kernels never read (QUANT is off)."""
    if (kv_cache.dtype == torch.int8) != (kv_scales is not None):
        raise CodegenError(
            f"a {kv_cache.dtype} kv_cache {'needs' if kv_scales is None else 'takes no'} kv_scales "
            "(fp32 [layers, 2, num_blocks, block_size, kv_heads], one per cached token and kv head)"
        )
    if kv_scales is None:
        return dict(k_scale_ptr=kv_cache, v_scale_ptr=kv_cache, stride_sb=0, stride_so=0, stride_sh=0)
    check_tensor(kv_scales, "kv_scales", ndim=5, dtypes=(torch.float32,))
    if kv_scales.shape != kv_cache.shape[:-1]:
        raise CodegenError(f"kv_scales has shape {tuple(kv_scales.shape)}; expected {tuple(kv_cache.shape[:-1])} "
                           "(kv_cache's shape without head_dim)")
    if kv_scales.stride(-1) != 1:
        raise CodegenError(f"kv_scales must have a unit last stride, strides {kv_scales.stride()}")
    check_same_device(kv_cache=kv_cache, kv_scales=kv_scales)
    stride_sb, stride_so, stride_sh = kv_scales.stride()[2:]
    return dict(k_scale_ptr=kv_scales[layer, 0], v_scale_ptr=kv_scales[layer, 1], stride_sb=stride_sb,
                stride_so=stride_so, stride_sh=stride_sh)


def _check_index(t: torch.Tensor, name: str, ndim: int, dtypes=(torch.int32,)) -> torch.Tensor:
    check_tensor(t, name, ndim=ndim, dtypes=dtypes)
    if not t.is_contiguous():
        raise CodegenError(f"{name} must be contiguous; call .contiguous()")
    return t


def paged_kv_write(
    k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor, layer: int, slot_mapping: torch.Tensor,
    kv_scales: torch.Tensor | None = None,
) -> None:  # fmt: skip
    """Write k/v rows ([N, Hkv * D] or [1, N, Hkv * D]) into kv_cache[layer] at slot_mapping [N] (< 0: skip);
    an int8 cache gets each row quantized, its scale written to kv_scales."""
    k, v = _rows(k, "k"), _rows(v, "v")
    k_cache, v_cache = _check_cache(kv_cache, layer)
    _check_index(slot_mapping, "slot_mapping", 1, _INDEX)
    _, block_size, kv_heads, head_dim = k_cache.shape
    for name, t in (("k", k), ("v", v)):
        if t.shape != (slot_mapping.shape[0], kv_heads * head_dim):
            raise CodegenError(
                f"{name} has shape {tuple(t.shape)}; expected [N={slot_mapping.shape[0]}, "
                f"kv_heads * head_dim = {kv_heads * head_dim}] to match slot_mapping and kv_cache"
            )
    check_same_device(k=k, v=v, kv_cache=kv_cache, slot_mapping=slot_mapping)
    scale_args = _scale_args(kv_cache, layer, kv_scales)
    del scale_args["stride_sh"]  # the write kernel stores one head row at a time: no head stride
    if k.shape[0] == 0:
        return
    quant = kv_scales is not None
    consts = {"BLOCK_H": next_power_of_2(kv_heads), "BLOCK_D": next_power_of_2(head_dim), "QUANT": quant}
    args = dict(k_ptr=k, v_ptr=v, slot_ptr=slot_mapping, stride_kt=k.stride(0), stride_vt=v.stride(0),
                **_cache_args(k_cache, v_cache), **scale_args, block_size=block_size, num_kv_heads=kv_heads,
                HEAD_DIM=head_dim)  # fmt: skip
    # No fp fusion when quantizing: x * inv + 0.5 must round twice, as the reference does, for identical caches.
    options = {"num_warps": 1, "enable_fp_fusion": False} if quant else {"num_warps": 1}
    launch("paged_kv_write", "paged_kv_write", (k.shape[0],), args, consts, options)


def _check_attention(q, kv_cache, layer, block_tables, context_lens, query_start_loc, num_heads, scale):
    q = _rows(q, "q")
    k_cache, v_cache = _check_cache(kv_cache, layer)
    _check_index(block_tables, "block_tables", 2)
    _check_index(context_lens, "context_lens", 1)
    _check_index(query_start_loc, "query_start_loc", 1)
    if query_start_loc.shape[0] != context_lens.shape[0] + 1 or block_tables.shape[0] != context_lens.shape[0]:
        raise CodegenError(
            f"query_start_loc {tuple(query_start_loc.shape)}, context_lens {tuple(context_lens.shape)}"
            f" and block_tables {tuple(block_tables.shape)} must describe the same S sequences"
        )
    kv_heads, head_dim = k_cache.shape[2:]
    if num_heads % kv_heads or q.shape[1] != num_heads * head_dim:
        raise CodegenError(
            f"q has {q.shape[1]} features; expected num_heads * head_dim = {num_heads} * {head_dim} "
            f"with num_heads a multiple of the cache's {kv_heads} kv heads"
        )
    if not 1 <= head_dim <= 256:  # below 16 the head is masked up to 16 (BLOCK_D), tl.dot's smallest K
        raise CodegenError(f"head_dim {head_dim} is outside the supported 1..256 (e.g. 64, 80, 96, 128, 256)")
    if not scale > 0:
        raise CodegenError(f"scale={scale} must be > 0 (the kernels fold it into exp2 after the row max)")
    if q.dtype != kv_cache.dtype and kv_cache.dtype != torch.int8:
        raise CodegenError(f"q has dtype {q.dtype} but kv_cache has {kv_cache.dtype}; use one dtype (or an int8 cache)")
    check_same_device(q=q, kv_cache=kv_cache, block_tables=block_tables, context_lens=context_lens,
                      query_start_loc=query_start_loc)  # fmt: skip
    return q, k_cache, v_cache, head_dim, num_heads // kv_heads


def paged_attention_decode(
    q: torch.Tensor, kv_cache: torch.Tensor, layer: int, block_tables: torch.Tensor, context_lens: torch.Tensor,
    query_start_loc: torch.Tensor, max_context_len: int, num_heads: int, window: int, scale: float,
    *, num_splits: int | None = None, out: torch.Tensor | None = None, kv_scales: torch.Tensor | None = None,
    tile: TileConfig | None = None,
) -> torch.Tensor:  # fmt: skip
    """Attention of one new query per sequence (at its last key's position) over its paged context, split-KV.

    q [N, H * D] or [1, N, H * D]; every sequence has at most one new row (query_start_loc). num_splits
    overrides choose_splits; splits partition the visible keys (the last `window` ones when window > 0).
    kv_scales: the scales of an int8 kv_cache. tile: the decode tile (paged_tiles.decode_tile's otherwise;
    its block_m must be the group's rows, max(16, next_power_of_2(num_heads // kv_heads))).
    """
    q, k_cache, v_cache, head_dim, group = _check_attention(
        q, kv_cache, layer, block_tables, context_lens, query_start_loc, num_heads, scale
    )
    scale_args = _scale_args(kv_cache, layer, kv_scales)
    out = check_out(out, q)
    n, num_seqs = q.shape[0], context_lens.shape[0]
    if tile is None:
        tile = decode_tile(q.device, q.dtype, kv_cache.dtype, head_dim, group)
    rows = max(16, next_power_of_2(group))
    if checked_tile(tile).block_m != rows:
        raise CodegenError(f"decode tile {tile} must have block_m = {rows} (the {group} query heads of a kv head)")
    block_n = tile.block_n
    # An explicit num_splits splits as asked; the default keeps every split at least MIN_SPLIT_KEYS long (the
    # kernel sizes splits per sequence, from its own context length).
    min_split = block_n if num_splits is not None else cdiv(MIN_SPLIT_KEYS, block_n) * block_n
    num_splits = decode_splits(num_seqs, k_cache.shape[2], max_context_len, window, block_n, q.device, num_splits)
    if n == 0 or num_seqs == 0:
        return out
    part_o = torch.empty(n, num_heads, num_splits, head_dim, dtype=torch.float32, device=q.device)
    part_lse = torch.empty(n, num_heads, num_splits, dtype=torch.float32, device=q.device)
    block_d = max(16, next_power_of_2(head_dim))
    consts = {"BLOCK_G": rows, "BLOCK_N": block_n, "BLOCK_D": block_d,
              "HAS_WINDOW": window > 0, "EVEN_D": head_dim == block_d, **dot_consts(q.dtype),
              "KV_QUANT": kv_scales is not None}  # fmt: skip
    (stride_pt, stride_ph, stride_ps), (stride_lt, stride_lh) = part_o.stride()[:3], part_lse.stride()[:2]
    partials = dict(part_o_ptr=part_o, part_lse_ptr=part_lse, stride_pt=stride_pt, stride_ph=stride_ph,
                    stride_ps=stride_ps, stride_lt=stride_lt, stride_lh=stride_lh)  # fmt: skip
    args = dict(q_ptr=q, **_cache_args(k_cache, v_cache), **scale_args, **partials, block_tables_ptr=block_tables,
                context_lens_ptr=context_lens, query_start_loc_ptr=query_start_loc, stride_qt=q.stride(0),
                stride_qh=head_dim, stride_bt=block_tables.stride(0), scale=float(scale), window=int(window),
                block_size=k_cache.shape[1], num_splits=num_splits, min_split=min_split, HEAD_DIM=head_dim,
                GROUP=group)  # fmt: skip
    grid = (num_seqs, k_cache.shape[2], num_splits)
    launch("paged_decode", "paged_attention_decode", grid, args, consts, tile.options())
    merge_args = dict(**partials, o_ptr=out, query_start_loc_ptr=query_start_loc, stride_ot=out.stride(0),
                      stride_oh=head_dim, num_seqs=num_seqs, num_splits=num_splits, HEAD_DIM=head_dim)  # fmt: skip
    merge_consts = {"BLOCK_S": next_power_of_2(num_splits), "BLOCK_D": block_d}
    launch("paged_merge", "split_kv_merge", (n, num_heads), merge_args, merge_consts, {"num_warps": 4})
    return out


def paged_attention_prefill(
    q: torch.Tensor, kv_cache: torch.Tensor, layer: int, block_tables: torch.Tensor, context_lens: torch.Tensor,
    query_start_loc: torch.Tensor, max_query_len: int, num_heads: int, causal: bool, window: int, scale: float,
    tile: TileConfig | None = None, *, out: torch.Tensor | None = None, kv_scales: torch.Tensor | None = None,
) -> torch.Tensor:  # fmt: skip
    """Attention of each sequence's new queries (a chunk aligned to the end of its keys) over its paged context.

    q [N, H * D] or [1, N, H * D]; max_query_len must bound every sequence's new rows (it sizes the grid).
    kv_scales: the scales of an int8 kv_cache.
    """
    q, k_cache, v_cache, head_dim, group = _check_attention(
        q, kv_cache, layer, block_tables, context_lens, query_start_loc, num_heads, scale
    )
    scale_args = _scale_args(kv_cache, layer, kv_scales)
    out = check_out(out, q)
    if tile is None:
        tile = prefill_tile(q.device, q.dtype, head_dim, bool(causal), window > 0)
    checked_tile(tile)
    num_seqs = context_lens.shape[0]
    if q.shape[0] == 0 or num_seqs == 0 or max_query_len <= 0:
        return out
    block_d = max(16, next_power_of_2(head_dim))
    consts = {"BLOCK_M": tile.block_m, "BLOCK_N": tile.block_n, "BLOCK_D": block_d, "CAUSAL": bool(causal),
              "HAS_WINDOW": window > 0, "EVEN_D": head_dim == block_d, **dot_consts(q.dtype),
              "KV_QUANT": kv_scales is not None}  # fmt: skip
    args = dict(q_ptr=q, **_cache_args(k_cache, v_cache), **scale_args, o_ptr=out, block_tables_ptr=block_tables,
                context_lens_ptr=context_lens, query_start_loc_ptr=query_start_loc, stride_qt=q.stride(0),
                stride_qh=head_dim, stride_ot=out.stride(0), stride_oh=head_dim, stride_bt=block_tables.stride(0),
                scale=float(scale), window=int(window), block_size=k_cache.shape[1], num_rows=q.shape[0],
                HEAD_DIM=head_dim, GROUP=group)  # fmt: skip
    # One sequence slot more: its programs zero the rows past query_start_loc[S] (see the module docstring).
    grid = (cdiv(max_query_len, tile.block_m), num_heads, num_seqs + 1)
    launch("paged_prefill", "paged_attention_prefill", grid, args, consts, tile.options())
    return out


def paged_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor, layer: int,
    slot_mapping: torch.Tensor, block_tables: torch.Tensor, context_lens: torch.Tensor,
    query_start_loc: torch.Tensor, max_query_len: int, max_context_len: int, num_heads: int, num_kv_heads: int,
    causal: bool, window: int, scale: float, kv_scales: torch.Tensor | None = None,
    *, num_splits: int | None = None, tile: TileConfig | None = None, out: torch.Tensor | None = None,
) -> torch.Tensor:  # fmt: skip
    """kiln::paged_attention: write the step's K/V into kv_cache, then attend (decode or prefill kernels).

    q [1, N, H * D] (or [N, H * D]) -> out of q's shape. The decode path runs when max_query_len == 1.
    kv_scales: the scales of an int8 kv_cache (quantized on write, dequantized on load).
    """
    if num_kv_heads != kv_cache.shape[-2]:
        raise CodegenError(f"num_kv_heads={num_kv_heads} but kv_cache holds {kv_cache.shape[-2]} kv heads")
    paged_kv_write(k, v, kv_cache, layer, slot_mapping, kv_scales)
    out = check_out(out, q)
    flat = out.view(-1, out.shape[-1])
    common = (kv_cache, layer, block_tables, context_lens, query_start_loc)
    if max_query_len == 1:
        paged_attention_decode(q, *common, max_context_len, num_heads, window, scale, num_splits=num_splits, out=flat,
                               kv_scales=kv_scales)  # fmt: skip
    else:
        paged_attention_prefill(q, *common, max_query_len, num_heads, causal, window, scale, tile, out=flat,
                                kv_scales=kv_scales)  # fmt: skip
    return out
