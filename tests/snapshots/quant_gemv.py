# kiln generated Triton kernel (template codegen/templates/quant_gemv.py.j2); do not edit
# family: quant_gemv
# kernel: quant_gemv_kernel
# op: linear_w4
# tile: BLOCK_K=128 BLOCK_N=16 num_warps=4
# params: BITS=4 GROUP=128 HAS_BIAS=False HAS_ZEROS=False
import triton
import triton.language as tl


@triton.jit
def quant_gemv_kernel(
    x_ptr, w_ptr, s_ptr, z_ptr, b_ptr, out_ptr,
    N, K,
    stride_xm, stride_wn, stride_sn, stride_zn, stride_om,
    BITS: tl.constexpr,
    GROUP: tl.constexpr,
    HAS_ZEROS: tl.constexpr,
    ZERO_IS_MIN: tl.constexpr,
    GROUP_SCALES8: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    # Decode GEMV: out[m, n] = sum_k x[m, k] * dequant(w)[n, k]. One program per (BLOCK_N outputs, row m);
    # the weight block streams through once per row, which is all decode (M small) reads.
    pid_n = tl.program_id(0)
    pid_m = tl.program_id(1).to(tl.int64)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_n = offs_n < N
    acc = tl.zeros((BLOCK_N,), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        mask_k = offs_k < K
        mask = mask_n[:, None] & mask_k[None, :]
        x = tl.load(x_ptr + pid_m * stride_xm + offs_k, mask=mask_k, other=0.0).to(tl.float32)
        if BITS == 8:
            # Per-channel scale: applied once after the K loop.
            w = tl.load(w_ptr + offs_n[:, None] * stride_wn + offs_k[None, :], mask=mask, other=0).to(tl.float32)
            if GROUP_SCALES8:  # a scale per group of GROUP along K (GGUF's Q8_0)
                w = w * tl.load(s_ptr + offs_n[:, None] * stride_sn + offs_k[None, :] // GROUP, mask=mask, other=0.0)
        else:
            # Two codes per byte along K (low nibble = even k); each byte is read for both of its codes.
            packed = tl.load(w_ptr + offs_n[:, None] * stride_wn + offs_k[None, :] // 2, mask=mask, other=0)
            q = ((packed.to(tl.int32) >> ((offs_k[None, :] % 2) * 4)) & 0xF).to(tl.float32)
            offs_g = offs_k[None, :] // GROUP
            s = tl.load(s_ptr + offs_n[:, None] * stride_sn + offs_g, mask=mask, other=0.0)
            if HAS_ZEROS:
                z = tl.load(z_ptr + offs_n[:, None] * stride_zn + offs_g, mask=mask, other=0).to(tl.float32)
            else:
                z = 8.0
            if ZERO_IS_MIN:
                w = q * s + z  # a float minimum per group (GGUF's Q4_1 kept as stored)
            else:
                w = (q - z) * s
        acc += tl.sum(w * x[None, :], axis=1)
    if BITS == 8 and not GROUP_SCALES8:
        acc = acc * tl.load(s_ptr + offs_n, mask=mask_n, other=0.0)
    if HAS_BIAS:
        acc += tl.load(b_ptr + offs_n, mask=mask_n, other=0.0).to(tl.float32)
    tl.store(out_ptr + pid_m * stride_om + offs_n, acc.to(out_ptr.dtype.element_ty), mask=mask_n)
