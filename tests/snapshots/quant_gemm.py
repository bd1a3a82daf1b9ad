# kiln generated Triton kernel (template codegen/templates/quant_gemm.py.j2); do not edit
# family: quant_gemm
# kernel: quant_gemm_kernel
# op: linear_w8
# tile: BLOCK_K=64 BLOCK_M=64 BLOCK_N=64 num_stages=3 num_warps=4
# params: BITS=8 DOT_FP32=False GROUP=1 HAS_BIAS=True HAS_ZEROS=False INPUT_PRECISION=None
import triton
import triton.language as tl


@triton.jit
def quant_gemm_kernel(
    x_ptr, w_ptr, s_ptr, z_ptr, b_ptr, out_ptr,
    M, N, K,
    stride_xm, stride_wn, stride_sn, stride_zn, stride_om,
    BITS: tl.constexpr,
    GROUP: tl.constexpr,
    HAS_ZEROS: tl.constexpr,
    ZERO_IS_MIN: tl.constexpr,
    GROUP_SCALES8: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    INPUT_PRECISION: tl.constexpr,
    DOT_FP32: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    # Prefill GEMM: a [BLOCK_M, BLOCK_N] output tile; each K step dequantizes a [BLOCK_K, BLOCK_N] weight tile
    # (w read transposed through its strides) into the activation dtype and accumulates x @ w in fp32.
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    offs_m = (pid_m * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_m = offs_m < M
    mask_n = offs_n < N
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        mask_k = offs_k < K
        x = tl.load(x_ptr + offs_m[:, None] * stride_xm + offs_k[None, :],
                    mask=mask_m[:, None] & mask_k[None, :], other=0.0)
        mask_w = mask_k[:, None] & mask_n[None, :]
        if BITS == 8:
            # int8 codes are exact in every float dtype; the per-channel scale is applied after the K loop.
            # (through fp32: a direct int8 -> bf16 cast is wrong in Triton's CPU interpreter)
            w = tl.load(w_ptr + offs_n[None, :] * stride_wn + offs_k[:, None], mask=mask_w, other=0).to(tl.float32)
            if GROUP_SCALES8:  # a scale per group of GROUP along K (GGUF's Q8_0)
                w = w * tl.load(s_ptr + offs_n[None, :] * stride_sn + offs_k[:, None] // GROUP, mask=mask_w, other=0.0)
        else:
            packed = tl.load(w_ptr + offs_n[None, :] * stride_wn + offs_k[:, None] // 2, mask=mask_w, other=0)
            q = ((packed.to(tl.int32) >> ((offs_k[:, None] % 2) * 4)) & 0xF).to(tl.float32)
            offs_g = offs_k[:, None] // GROUP
            s = tl.load(s_ptr + offs_n[None, :] * stride_sn + offs_g, mask=mask_w, other=0.0)
            if HAS_ZEROS:
                z = tl.load(z_ptr + offs_n[None, :] * stride_zn + offs_g, mask=mask_w, other=0).to(tl.float32)
            else:
                z = 8.0
            if ZERO_IS_MIN:
                w = q * s + z  # a float minimum per group (GGUF's Q4_1 kept as stored)
            else:
                w = (q - z) * s
        if DOT_FP32:
            acc = tl.dot(x.to(tl.float32), w.to(tl.float32), acc, input_precision=INPUT_PRECISION)
        else:
            acc = tl.dot(x, w.to(x.dtype), acc, input_precision=INPUT_PRECISION)
    if BITS == 8 and not GROUP_SCALES8:
        acc = acc * tl.load(s_ptr + offs_n, mask=mask_n, other=0.0)[None, :]
    if HAS_BIAS:
        acc += tl.load(b_ptr + offs_n, mask=mask_n, other=0.0).to(tl.float32)[None, :]
    out_ptrs = out_ptr + offs_m[:, None] * stride_om + offs_n[None, :]
    tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=mask_m[:, None] & mask_n[None, :])
