# kiln generated Triton kernel (template codegen/templates/paged_kv_write.py.j2); do not edit
# family: paged_kv_write
# kernel: paged_kv_write_kernel
# op: paged_kv_write
# tile: BLOCK_D=128 BLOCK_H=8 num_warps=1
# params: -
import triton
import triton.language as tl


@triton.jit
def paged_kv_write_kernel(
    k_ptr, v_ptr, k_cache_ptr, v_cache_ptr, slot_ptr, k_scale_ptr, v_scale_ptr,
    stride_kt, stride_vt,
    stride_cb, stride_co, stride_ch,
    stride_sb, stride_so,
    block_size, num_kv_heads, HEAD_DIM,
    BLOCK_H: tl.constexpr,
    BLOCK_D: tl.constexpr,
    QUANT: tl.constexpr,
):
    # Paged KV write: program t copies new token t's k and v rows [kv_heads, head_dim] into its cache slot.
    # Slot s is block s // block_size, offset s % block_size of the [blocks, block_size, kv_heads, head_dim]
    # cache of one layer; a negative slot marks a padding token and writes nothing. QUANT (an int8 cache): each
    # row [head_dim] of a head is stored as round(x * 127 / absmax) with its scale absmax / 127 in the
    # [blocks, block_size, kv_heads] scales (the arithmetic of kiln.ir.ops_paged.quantize_kv, IEEE division).
    tok = tl.program_id(0)
    slot = tl.load(slot_ptr + tok).to(tl.int64)  # int64 offsets: a cache can exceed 2**31 elements
    block = slot // block_size
    offset = slot % block_size
    offs_h = tl.arange(0, BLOCK_H)
    offs_d = tl.arange(0, BLOCK_D)
    valid = (offs_h * 0 + slot) >= 0  # the slot check as a vector (a scalar mask term trips the interpreter)
    mask = (offs_h[:, None] < num_kv_heads) & (offs_d[None, :] < HEAD_DIM) & valid[:, None]
    src = offs_h[:, None] * HEAD_DIM + offs_d[None, :]
    dst = block * stride_cb + offset * stride_co + offs_h[:, None] * stride_ch + offs_d[None, :]
    k = tl.load(k_ptr + tok.to(tl.int64) * stride_kt + src, mask=mask, other=0.0)
    v = tl.load(v_ptr + tok.to(tl.int64) * stride_vt + src, mask=mask, other=0.0)
    if QUANT:
        scale_dst = block * stride_sb + offset * stride_so + offs_h
        mask_h = (offs_h < num_kv_heads) & valid
        k, k_scale = _quantize(k)
        v, v_scale = _quantize(v)
        tl.store(k_scale_ptr + scale_dst, k_scale, mask=mask_h)
        tl.store(v_scale_ptr + scale_dst, v_scale, mask=mask_h)
    tl.store(k_cache_ptr + dst, k.to(k_cache_ptr.dtype.element_ty), mask=mask)
    tl.store(v_cache_ptr + dst, v.to(v_cache_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _quantize(x):
    # Symmetric int8 per row: values round(x * 127 / absmax) (half up, as floor(y + 0.5)), scale absmax / 127.
    # The host launches this kernel without fp fusion, so x * inv + 0.5 rounds twice, as torch does.
    x = x.to(tl.float32)
    absmax = tl.max(tl.abs(x), 1)
    safe = tl.where(absmax > 0, absmax, 1.0)
    inv = tl.where(absmax > 0, tl.div_rn(tl.full(absmax.shape, 127.0, tl.float32), safe), 0.0)
    y = tl.floor(x * inv[:, None] + 0.5)
    y = tl.minimum(tl.maximum(y, -127.0), 127.0)
    return y, tl.div_rn(absmax, tl.full(absmax.shape, 127.0, tl.float32))
