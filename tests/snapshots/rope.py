# kiln generated Triton kernel (template codegen/templates/rope.py.j2); do not edit
# family: rope
# kernel: rope_kernel
# op: rope
# tile: BLOCK_H=4 BLOCK_HALF=32 num_warps=4
# params: -
import triton
import triton.language as tl


@triton.jit
def rope_kernel(
    x_ptr, pos_ptr, inv_freq_ptr, out_ptr,
    stride_xb, stride_xt, stride_xf,
    stride_pb, stride_pt,
    stride_ob, stride_ot, stride_of,
    T, H, HALF,
    BLOCK_H: tl.constexpr,
    BLOCK_HALF: tl.constexpr,
):
    # One program per (token, block of heads). Rotate-half form: with x = [x1, x2] per head,
    # out = [x1 * cos - x2 * sin, x2 * cos + x1 * sin] where the angle is position * inv_freq.
    pid_bt = tl.program_id(0).to(tl.int64)
    pid_h = tl.program_id(1)
    b = pid_bt // T
    t = pid_bt % T
    offs_h = pid_h * BLOCK_H + tl.arange(0, BLOCK_H)
    offs_f = tl.arange(0, BLOCK_HALF)
    mask_f = offs_f < HALF
    mask = (offs_h[:, None] < H) & mask_f[None, :]

    pos = tl.load(pos_ptr + b * stride_pb + t * stride_pt).to(tl.float32)
    inv_freq = tl.load(inv_freq_ptr + offs_f, mask=mask_f, other=0.0).to(tl.float32)
    angle = pos * inv_freq
    # Like the reference, the tables are rounded to the activation dtype, and so is each product; the
    # arithmetic itself runs in fp32 (for fp32 inputs the roundings are no-ops).
    dtype = x_ptr.dtype.element_ty
    cos = tl.cos(angle).to(dtype).to(tl.float32)[None, :]
    sin = tl.sin(angle).to(dtype).to(tl.float32)[None, :]

    # Feature index of element f of head h's first half; the second half sits HALF further on.
    feat = offs_h[:, None] * (2 * HALF) + offs_f[None, :]
    x_row = x_ptr + b * stride_xb + t * stride_xt
    x1 = tl.load(x_row + feat * stride_xf, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(x_row + (feat + HALF) * stride_xf, mask=mask, other=0.0).to(tl.float32)
    # Both halves are loaded before any store, so out may alias x (in-place rotation).
    out1 = (x1 * cos).to(dtype).to(tl.float32) - (x2 * sin).to(dtype).to(tl.float32)
    out2 = (x2 * cos).to(dtype).to(tl.float32) + (x1 * sin).to(dtype).to(tl.float32)
    o_row = out_ptr + b * stride_ob + t * stride_ot
    tl.store(o_row + feat * stride_of, out1.to(out_ptr.dtype.element_ty), mask=mask)
    tl.store(o_row + (feat + HALF) * stride_of, out2.to(out_ptr.dtype.element_ty), mask=mask)
