# kiln generated Triton kernel (template codegen/templates/paged_prefill.py.j2); do not edit
# family: paged_prefill
# kernel: paged_prefill_kernel
# op: paged_attention_prefill
# tile: BLOCK_D=128 BLOCK_M=128 BLOCK_N=64 num_stages=3 num_warps=8
# params: CAUSAL=True HAS_WINDOW=True INPUT_PRECISION=None
import triton
import triton.language as tl


@triton.jit
def paged_prefill_kernel(
    q_ptr, k_cache_ptr, v_cache_ptr, k_scale_ptr, v_scale_ptr, o_ptr,
    block_tables_ptr, context_lens_ptr, query_start_loc_ptr,
    stride_qt, stride_qh, stride_ot, stride_oh,
    stride_cb, stride_co, stride_ch,
    stride_sb, stride_so, stride_sh,
    stride_bt,
    scale, window, block_size,
    HEAD_DIM, GROUP,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
    CAUSAL: tl.constexpr,
    HAS_WINDOW: tl.constexpr,
    INPUT_PRECISION: tl.constexpr,
    KV_QUANT: tl.constexpr,
):
    # Paged prefill attention: program (query block, head, sequence). The sequence's new queries are rows
    # query_start_loc[s]:query_start_loc[s + 1] of q; its keys are the first context_lens[s] tokens of its
    # cache (the cached prefix and this chunk, already written), gathered through its block table. Queries are
    # aligned to the end of the keys; online softmax with fp32 accumulation as in flash_attn.
    pid_m = tl.program_id(0)
    head = tl.program_id(1)
    seq = tl.program_id(2)
    kv_head = head // GROUP  # GQA by index
    q_start = tl.load(query_start_loc_ptr + seq)
    q_len = tl.load(query_start_loc_ptr + seq + 1) - q_start
    k_len = tl.load(context_lens_ptr + seq)

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

    shift = k_len - q_len  # query m sits at key position m + shift
    rows = offs_m + shift
    first_row = pid_m * BLOCK_M + shift
    last_row = tl.minimum(pid_m * BLOCK_M + BLOCK_M, q_len) - 1 + shift
    lo = 0
    hi = k_len
    if CAUSAL:
        hi = tl.minimum(hi, last_row + 1)
    if HAS_WINDOW:
        lo = tl.maximum(first_row - window + 1, 0) // BLOCK_N * BLOCK_N
        if not CAUSAL:
            hi = tl.minimum(hi, last_row + window)
    hi = tl.where(pid_m * BLOCK_M < q_len, hi, lo)  # a block past this sequence's queries does no work

    table = block_tables_ptr + seq.to(tl.int64) * stride_bt
    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    qk_scale = scale * 1.4426950408889634  # log2(e): the softmax runs on exp2
    for start_n in range(lo, hi, BLOCK_N):
        cols = start_n + offs_n
        mask_n = cols < k_len
        # Key j lives in block table[j // block_size] at offset j % block_size.
        blocks = tl.load(table + cols // block_size, mask=mask_n, other=0).to(tl.int64)
        k_rows = blocks * stride_cb + (cols % block_size) * stride_co + kv_head * stride_ch
        kt = tl.load(k_cache_ptr + k_rows[None, :] + offs_d[:, None], mask=mask_n[None, :] & mask_d[:, None], other=0.0)
        # An int8 cache's values are exact in q's dtype; the per-key scales multiply the product's columns.
        qk = tl.dot(q, kt.to(q.dtype), input_precision=INPUT_PRECISION) * qk_scale
        if KV_QUANT:
            s_rows = blocks * stride_sb + (cols % block_size) * stride_so + kv_head * stride_sh
            qk = qk * tl.load(k_scale_ptr + s_rows, mask=mask_n, other=0.0)[None, :]
        visible = mask_n[None, :]
        if CAUSAL:
            visible = visible & (cols[None, :] <= rows[:, None])
        if HAS_WINDOW:
            visible = visible & (cols[None, :] > rows[:, None] - window)
            if not CAUSAL:
                visible = visible & (cols[None, :] < rows[:, None] + window)
        qk = tl.where(visible, qk, float("-inf"))

        m_new = tl.maximum(m_i, tl.max(qk, 1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # a row with no visible key yet: exp2(-inf) = 0
        p = tl.math.exp2(qk - m_safe[:, None])
        alpha = tl.math.exp2(m_i - m_safe)
        l_i = l_i * alpha + tl.sum(p, 1)
        v = tl.load(v_cache_ptr + k_rows[:, None] + offs_d[None, :], mask=mask_n[:, None] & mask_d[None, :], other=0.0)
        if KV_QUANT:
            p = p * tl.load(v_scale_ptr + s_rows, mask=mask_n, other=0.0)[None, :]  # V's scales, after l_i
        acc = acc * alpha[:, None]
        acc = tl.dot(p.to(q.dtype), v.to(q.dtype), acc, input_precision=INPUT_PRECISION)
        m_i = m_new

    out = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]
    tl.store(
        o_ptr + q_rows[:, None] * stride_ot + head * stride_oh + offs_d[None, :],
        out.to(o_ptr.dtype.element_ty),
        mask=mask_m[:, None] & mask_d[None, :],
    )
