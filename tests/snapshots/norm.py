# kiln generated Triton kernel (template codegen/templates/norm.py.j2); do not edit
# family: norm
# kernel: norm_kernel
# op: rms_norm
# tile: BLOCK_D=128 num_warps=4
# params: HAS_BIAS=False HAS_RESIDUAL=True IS_RMS=True
import triton
import triton.language as tl


@triton.jit
def norm_kernel(
    x_ptr, res_ptr, w_ptr, b_ptr, out_ptr, res_out_ptr,
    stride_x, stride_res, stride_out, stride_res_out,
    D, eps,
    BLOCK_D: tl.constexpr,
    IS_RMS: tl.constexpr,
    HAS_RESIDUAL: tl.constexpr,
    HAS_BIAS: tl.constexpr,
):
    # One program per row; the whole row fits in one block (BLOCK_D >= D, masked).
    row = tl.program_id(0).to(tl.int64)
    offs_d = tl.arange(0, BLOCK_D)
    mask = offs_d < D
    x = tl.load(x_ptr + row * stride_x + offs_d, mask=mask, other=0.0)
    if HAS_RESIDUAL:
        # The sum is rounded to the activation dtype (like kiln::add) and handed on as the next residual.
        r = tl.load(res_ptr + row * stride_res + offs_d, mask=mask, other=0.0)
        x = (x.to(tl.float32) + r.to(tl.float32)).to(x.dtype)
        tl.store(res_out_ptr + row * stride_res_out + offs_d, x, mask=mask)
    xf = x.to(tl.float32)
    w = tl.load(w_ptr + offs_d, mask=mask, other=0.0)
    if IS_RMS:
        mean_sq = tl.sum(xf * xf, axis=0) / D
        normed = xf * tl.rsqrt(mean_sq + eps)
        # HF order: round the normalized row and the weight to the activation dtype, then multiply
        # (in fp32, rounded once on store: the same bits as a bf16/fp16 multiply).
        y = w.to(x.dtype).to(tl.float32) * normed.to(x.dtype).to(tl.float32)
    else:
        mean = tl.sum(xf, axis=0) / D
        diff = tl.where(mask, xf - mean, 0.0)
        var = tl.sum(diff * diff, axis=0) / D
        y = diff * tl.rsqrt(var + eps) * w.to(tl.float32)
        if HAS_BIAS:
            y += tl.load(b_ptr + offs_d, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * stride_out + offs_d, y.to(out_ptr.dtype.element_ty), mask=mask)
