"""Host wrappers for the flash_attn family (templates/flash_attn.py.j2): prefill attention over packed
variable-length sequences, and a dense-batch form with the signature of kiln::attention."""

from __future__ import annotations

import functools
from collections import OrderedDict

import torch

from kiln import env
from kiln.codegen._host import (
    cdiv,
    check_out,
    check_same_device,
    check_tensor,
    dot_consts,
    launch,
    next_power_of_2,
)
from kiln.codegen.tiles import TileConfig, default_tile
from kiln.errors import CodegenError

# A tile is checked once per value, not on every launch: a lowered graph passes the same tiles (its nodes' constants,
# the memoized defaults) launch after launch, and a TileConfig is frozen.
checked_tile = functools.cache(TileConfig.validate)


@functools.cache
def _default_tile(device: torch.device, dtype: torch.dtype, head_dim: int) -> TileConfig:
    """The heuristic tile for q's device (its compute capability is asked once per device), dtype and head size."""
    capability = torch.cuda.get_device_capability(device) if device.type == "cuda" else None
    return checked_tile(default_tile(head_dim, dtype, capability))


def _head_dim(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, num_heads: int, num_kv_heads: int) -> int:
    if num_heads <= 0 or num_kv_heads <= 0 or num_heads % num_kv_heads:
        raise CodegenError(
            f"num_heads={num_heads} must be a positive multiple of num_kv_heads={num_kv_heads} (GQA groups)"
        )
    if q.shape[-1] % num_heads:
        raise CodegenError(f"q has {q.shape[-1]} features, not a multiple of num_heads={num_heads}")
    head_dim = q.shape[-1] // num_heads
    if not 1 <= head_dim <= 256:  # below 16 the head is masked up to 16, tl.dot's smallest K
        raise CodegenError(f"head_dim {head_dim} is outside the supported 1..256 (e.g. 64, 80, 96, 128, 256)")
    for name, t in (("k", k), ("v", v)):
        if t.shape[-1] != num_kv_heads * head_dim:
            raise CodegenError(
                f"{name} has {t.shape[-1]} features; expected num_kv_heads * head_dim = {num_kv_heads * head_dim}"
            )
        if t.dtype != q.dtype:
            raise CodegenError(f"{name} has dtype {t.dtype} but q has {q.dtype}; cast them to one dtype")
    return head_dim


@functools.cache
def _cuda_tma_blocker(device: torch.device) -> str | None:
    """Why a CUDA device cannot load through TMA descriptors, or None when it can: asked once per device (its
    capability does not change, and TMA launches would otherwise ask the driver every time)."""
    if torch.cuda.get_device_capability(device) < (9, 0):
        return f"{torch.cuda.get_device_name(device)} has no TMA (sm90+ only)"
    return None


def _device_tma_blocker(device: torch.device) -> str | None:
    if device.type == "cuda":
        return _cuda_tma_blocker(device)
    # off a GPU only the interpreter runs descriptors; a setting, not the device's: read on each call
    return None if env.triton_interpret() else f"q is on {device}"


def _tma_blocker(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, head_dim: int, block_d: int) -> str | None:
    """Why these inputs cannot go through TMA descriptors, or None when they can."""
    if head_dim != block_d:
        return f"head_dim {head_dim} is not a power of two >= 16 (a descriptor's box is one head)"
    for name, t in (("q", q), ("k", k), ("v", v)):
        if t.data_ptr() % 16 or (t.stride(0) * t.element_size()) % 16:
            return f"{name}'s rows are not 16-byte aligned (stride {t.stride()}, offset {t.storage_offset()})"
    return _device_tma_blocker(q.device)


def _use_tma(tma: bool | None, q, k, v, head_dim: int, block_d: int) -> bool:
    if tma is False or (tma is None and not (q.is_cuda and env.flash_tma())):
        return False
    blocker = _tma_blocker(q, k, v, head_dim, block_d)
    if blocker is not None and tma:
        raise CodegenError(f"flash attention with tma=True: {blocker}; pass tma=None to fall back to pointer loads")
    return blocker is None


def _descriptors(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, tile: TileConfig, block_d: int) -> tuple:
    # lazy: importing triton here, not at module import, keeps TRITON_INTERPRET settable until the first launch
    from triton.tools.tensor_descriptor import TensorDescriptor

    def desc(t: torch.Tensor, rows: int) -> TensorDescriptor:
        return TensorDescriptor(base=t, shape=list(t.shape), strides=[t.stride(0), 1], block_shape=[rows, block_d])

    return desc(q, tile.block_m), desc(k, tile.block_n), desc(v, tile.block_n)


# Dense batches' sequence offsets by (device, sequences, length): made once, not on every launch. The kernel only
# reads them, so one tensor serves every call of that shape. A server sees many prompt shapes, so past OFFSETS_MAX the
# least recently used goes. One that a CUDA graph captured is pinned instead, never dropped: the graph replays reading
# its address (a few int32s per captured shape). OrderedDict's move_to_end and popitem are single calls, so threads
# launching at once need no lock.
OFFSETS_MAX = 64
_OFFSETS: OrderedDict[tuple[torch.device, int, int], torch.Tensor] = OrderedDict()
_PINNED: dict[tuple[torch.device, int, int], torch.Tensor] = {}


def _capturing(device: torch.device) -> bool:
    return device.type == "cuda" and torch.cuda.is_current_stream_capturing()


def _dense_offsets(device: torch.device, count: int, length: int) -> torch.Tensor:
    """int32 [0, length, ..., count * length] on device: `count` sequences of `length` rows each, packed."""
    key = (device, count, length)
    offsets = _PINNED.get(key)
    if offsets is not None:
        return offsets
    capturing = _capturing(device)
    offsets = _OFFSETS.get(key)
    if offsets is not None:
        if capturing:
            _PINNED[key] = offsets
            _OFFSETS.pop(key, None)
        else:
            try:
                _OFFSETS.move_to_end(key)
            except KeyError:  # another thread's miss evicted it meanwhile: this call still has it
                pass
        return offsets
    offsets = torch.arange(0, (count + 1) * length, length, dtype=torch.int32, device=device)
    # Kept only when it holds real values: not a FakeTensor (a dry run's) or a meta tensor, nor one made while a
    # CUDA graph is captured (its values are written only when the graph replays).
    if type(offsets) is torch.Tensor and device.type != "meta" and not capturing:
        _OFFSETS[key] = offsets
        while len(_OFFSETS) > OFFSETS_MAX:
            try:
                _OFFSETS.popitem(last=False)
            except KeyError:  # another thread emptied it first
                break
    return offsets


def flash_attention_varlen(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    cu_seqlens_k: torch.Tensor,
    max_seqlen_q: int,
    max_seqlen_k: int,
    num_heads: int,
    num_kv_heads: int,
    causal: bool,
    window: int,
    scale: float,
    tile: TileConfig | None = None,
    *,
    out: torch.Tensor | None = None,
    tma: bool | None = None,
) -> torch.Tensor:
    """Attention over packed sequences: q [total_q, H * D], k/v [total_k, Hkv * D] -> [total_q, H * D].

    Sequence s is rows cu_seqlens_q[s]:cu_seqlens_q[s + 1] of q and cu_seqlens_k[s]:cu_seqlens_k[s + 1] of
    k/v (int32, [num_seqs + 1]); its queries are aligned to the end of its keys. max_seqlen_q must bound every
    query length (it sizes the grid; the cu_seqlens values are not read back to the host). window > 0
    keeps the last `window` keys (the query itself included), as in kiln::attention. tma: load Q/K/V through
    TMA tensor descriptors (sm90+, head dims of 16, 32, 64, 128 or 256, 16-byte aligned rows); None: when
    KILN_FLASH_TMA=1 and the inputs allow it.
    """
    for name, t in (("q", q), ("k", k), ("v", v)):
        check_tensor(t, name, ndim=2)
    for name, t in (("cu_seqlens_q", cu_seqlens_q), ("cu_seqlens_k", cu_seqlens_k)):
        check_tensor(t, name, ndim=1, dtypes=(torch.int32,))
        if not t.is_contiguous() or t.shape[0] < 2:
            raise CodegenError(f"{name} must be a contiguous int32 [num_seqs + 1] tensor, got shape {tuple(t.shape)}")
    if cu_seqlens_q.shape != cu_seqlens_k.shape:
        raise CodegenError(
            f"cu_seqlens_q {tuple(cu_seqlens_q.shape)} and cu_seqlens_k {tuple(cu_seqlens_k.shape)} "
            "must describe the same number of sequences"
        )
    if k.shape[0] != v.shape[0]:
        raise CodegenError(f"k has {k.shape[0]} tokens but v has {v.shape[0]}")
    if max_seqlen_q < 0 or max_seqlen_k < 0:
        raise CodegenError(f"max_seqlen_q={max_seqlen_q} and max_seqlen_k={max_seqlen_k} must be >= 0")
    head_dim = _head_dim(q, k, v, num_heads, num_kv_heads)
    check_same_device(q=q, k=k, v=v, cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k)
    out = check_out(out, q)
    tile = _default_tile(q.device, q.dtype, head_dim) if tile is None else checked_tile(tile)
    if not scale > 0:
        raise CodegenError(f"scale={scale} must be > 0 (the kernels fold it into exp2 after the row max)")
    block_d = max(16, next_power_of_2(head_dim))
    consts = {
        "BLOCK_M": tile.block_m,
        "BLOCK_N": tile.block_n,
        "BLOCK_D": block_d,
        "CAUSAL": bool(causal),
        "HAS_WINDOW": window > 0,
        "EVEN_D": head_dim == block_d,  # no head-dim bound on the K/V loads
        **dot_consts(q.dtype),
    }
    num_seqs = cu_seqlens_q.shape[0] - 1
    if max_seqlen_q <= 0 or q.shape[0] == 0:  # no queries (descriptors need positive shapes)
        return out
    consts["USE_TMA"] = _use_tma(tma, q, k, v, head_dim, block_d)
    descs = _descriptors(q, k, v, tile, block_d) if consts["USE_TMA"] else (None, None, None)
    args = dict(
        q_ptr=q, k_ptr=k, v_ptr=v, o_ptr=out, q_desc=descs[0], k_desc=descs[1], v_desc=descs[2],
        cu_seqlens_q_ptr=cu_seqlens_q, cu_seqlens_k_ptr=cu_seqlens_k,
        stride_qt=q.stride(0), stride_qh=head_dim, stride_kt=k.stride(0), stride_kh=head_dim,
        stride_vt=v.stride(0), stride_vh=head_dim, stride_ot=out.stride(0), stride_oh=head_dim,
        scale=float(scale), window=int(window), HEAD_DIM=head_dim, GROUP=num_heads // num_kv_heads,
    )  # fmt: skip
    grid = (cdiv(max_seqlen_q, tile.block_m), num_heads, num_seqs)
    launch("flash_attn", "attention", grid, args, consts, tile.options())
    return out


def flash_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    num_heads: int,
    num_kv_heads: int,
    causal: bool,
    window: int,
    scale: float,
    tile: TileConfig | None = None,
    *,
    out: torch.Tensor | None = None,
    tma: bool | None = None,
) -> torch.Tensor:
    """kiln::attention on dense batches: q [B, T, H * D], k/v [B, S, Hkv * D] -> [B, T, H * D] (S >= T)."""
    for name, t in (("q", q), ("k", k), ("v", v)):
        check_tensor(t, name, ndim=3)
    b, t, _ = q.shape
    s = k.shape[1]
    if k.shape[:2] != (b, s) or v.shape[:2] != (b, s) or k.shape[0] != b:
        raise CodegenError(f"k {tuple(k.shape)} and v {tuple(v.shape)} must be [B, S, Hkv * D] with q's batch B={b}")
    out = check_out(out, q)
    if b == 0 or t == 0:  # no queries: nothing to compute (and no zero-step offsets below)
        return out
    # A dense batch is a packed batch of equal lengths; reshape is a view for contiguous (or row-sliced) inputs.
    cu_q = _dense_offsets(q.device, b, t)
    # Self-attention (kiln's graphs: S == T) reads the same offsets for keys; the kernel only reads them.
    cu_k = cu_q if s == t else _dense_offsets(q.device, b, s)
    flash_attention_varlen(
        q.reshape(b * t, -1), k.reshape(b * s, -1), v.reshape(b * s, -1), cu_q, cu_k, t, s, num_heads=num_heads,
        num_kv_heads=num_kv_heads, causal=causal, window=window, scale=scale, tile=tile, out=out.view(b * t, -1),
        tma=tma,
    )  # fmt: skip
    return out
