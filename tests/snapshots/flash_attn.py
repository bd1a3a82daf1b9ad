# kiln generated Triton kernel (template codegen/templates/flash_attn.py.j2); do not edit
# family: flash_attn
# kernel: flash_attn_kernel
# op: attention
# tile: BLOCK_D=128 BLOCK_M=128 BLOCK_N=64 num_stages=3 num_warps=8
# params: CAUSAL=True HAS_WINDOW=False INPUT_PRECISION=None
import triton
import triton.language as tl


@triton.jit
def flash_attn_kernel(
    q_ptr, k_ptr, v_ptr, o_ptr,
    cu_seqlens_q_ptr, cu_seqlens_k_ptr,
    stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_ot, stride_oh,
    scale, window,
    HEAD_DIM, GROUP,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
    CAUSAL: tl.constexpr,
    HAS_WINDOW: tl.constexpr,
    INPUT_PRECISION: tl.constexpr,
):
    # Flash-attention forward over packed sequences: program (query block, head, sequence).
    # Sequence s owns rows cu_seqlens[s]:cu_seqlens[s + 1] of the packed [tokens, heads * head_dim] tensors.
    pid_m = tl.program_id(0)
    head = tl.program_id(1)
    seq = tl.program_id(2)
    kv_head = head // GROUP  # GQA: query heads share K/V by index, K/V are never repeated in memory
    q_start = tl.load(cu_seqlens_q_ptr + seq)
    q_len = tl.load(cu_seqlens_q_ptr + seq + 1) - q_start
    k_start = tl.load(cu_seqlens_k_ptr + seq)
    k_len = tl.load(cu_seqlens_k_ptr + seq + 1) - k_start

    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    mask_m = offs_m < q_len
    mask_d = offs_d < HEAD_DIM
    q_rows = (q_start + offs_m).to(tl.int64)
    q = tl.load(
        q_ptr + q_rows[:, None] * stride_qt + head * stride_qh + offs_d[None, :],
        mask=mask_m[:, None] & mask_d[None, :],
        other=0.0,
    )

    # Queries are aligned to the end of their keys (a cached prefix): query m sits at key position m + shift.
    shift = k_len - q_len
    rows = offs_m + shift
    first_row = pid_m * BLOCK_M + shift
    last_row = tl.minimum(pid_m * BLOCK_M + BLOCK_M, q_len) - 1 + shift
    # Key range this block can see; blocks outside it are fully masked and skipped.
    lo = 0
    hi = k_len
    if CAUSAL:
        hi = tl.minimum(hi, last_row + 1)
    if HAS_WINDOW:
        lo = tl.maximum(first_row - window + 1, 0) // BLOCK_N * BLOCK_N
        if not CAUSAL:
            hi = tl.minimum(hi, last_row + window)
    hi = tl.where(pid_m * BLOCK_M < q_len, hi, lo)  # a block past this sequence's end does no work

    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    qk_scale = scale * 1.4426950408889634  # log2(e): the softmax runs on exp2
    for start_n in range(lo, hi, BLOCK_N):
        cols = start_n + offs_n
        mask_n = cols < k_len
        k_rows = (k_start + cols).to(tl.int64)
        kt = tl.load(
            k_ptr + k_rows[None, :] * stride_kt + kv_head * stride_kh + offs_d[:, None],
            mask=mask_n[None, :] & mask_d[:, None],
            other=0.0,
        )
        qk = tl.dot(q, kt, input_precision=INPUT_PRECISION) * qk_scale
        visible = mask_n[None, :]
        if CAUSAL:
            visible = visible & (cols[None, :] <= rows[:, None])
        if HAS_WINDOW:
            visible = visible & (cols[None, :] > rows[:, None] - window)
            if not CAUSAL:
                visible = visible & (cols[None, :] < rows[:, None] + window)
        qk = tl.where(visible, qk, float("-inf"))

        # Online softmax: rescale what was accumulated so far to the new running max.
        m_new = tl.maximum(m_i, tl.max(qk, 1))
        # A row that has seen no visible key keeps m = -inf; subtracting 0 then gives exp2(-inf) = 0, not NaN.
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        p = tl.math.exp2(qk - m_safe[:, None])
        alpha = tl.math.exp2(m_i - m_safe)
        l_i = l_i * alpha + tl.sum(p, 1)
        v = tl.load(
            v_ptr + k_rows[:, None] * stride_vt + kv_head * stride_vh + offs_d[None, :],
            mask=mask_n[:, None] & mask_d[None, :],
            other=0.0,
        )
        acc = acc * alpha[:, None]
        acc = tl.dot(p.to(v.dtype), v, acc, input_precision=INPUT_PRECISION)
        m_i = m_new

    # Rows with no visible key at all (only possible when a sequence has more queries than keys) give 0;
    # padding rows past q_len are computed the same way and masked off on store.
    out = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]
    tl.store(
        o_ptr + q_rows[:, None] * stride_ot + head * stride_oh + offs_d[None, :],
        out.to(o_ptr.dtype.element_ty),
        mask=mask_m[:, None] & mask_d[None, :],
    )
