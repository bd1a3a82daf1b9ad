# kiln generated Triton kernel (template codegen/templates/paged_decode.py.j2); do not edit
# family: paged_decode
# kernel: paged_decode_kernel
# op: paged_attention_decode
# tile: BLOCK_D=128 BLOCK_G=16 BLOCK_N=64 num_stages=2 num_warps=4
# params: HAS_WINDOW=False INPUT_PRECISION=None
import triton
import triton.language as tl


@triton.jit
def paged_decode_kernel(
    q_ptr, k_cache_ptr, v_cache_ptr, k_scale_ptr, v_scale_ptr, part_o_ptr, part_lse_ptr,
    block_tables_ptr, context_lens_ptr, query_start_loc_ptr,
    stride_qt, stride_qh,
    stride_cb, stride_co, stride_ch,
    stride_sb, stride_so, stride_sh,
    stride_bt,
    stride_pt, stride_ph, stride_ps,
    stride_lt, stride_lh,
    scale, window, block_size, num_splits, min_split,
    HEAD_DIM, GROUP,
    BLOCK_G: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
    HAS_WINDOW: tl.constexpr,
    INPUT_PRECISION: tl.constexpr,
    KV_QUANT: tl.constexpr,
):
    # Split-KV decode (flash decoding): program (sequence, kv head, split) attends the sequence's one new query,
    # for all GROUP query heads that share this kv head (packed as the M rows of the tile), over the split'th
    # keys of its visible context, read from the paged cache through its block table. It writes that split's
    # normalized output and log2-sum-exp; the merge kernel combines the splits. The split length comes from this
    # sequence's context length (read here, on the device), not from the host's bound: a CUDA graph captured
    # for max_model_len splits a short context as evenly as an eager step would.
    seq = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    q_start = tl.load(query_start_loc_ptr + seq)
    q_len = tl.load(query_start_loc_ptr + seq + 1) - q_start
    ctx = tl.load(context_lens_ptr + seq)

    offs_g = tl.arange(0, BLOCK_G)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    heads = kv_head * GROUP + offs_g
    mask_g = offs_g < GROUP * tl.minimum(q_len, 1)  # a sequence without a new token (q_len 0) writes nothing
    mask_d = offs_d < HEAD_DIM
    q_row = q_start.to(tl.int64)  # the sequence's one query row
    q = tl.load(
        q_ptr + q_row * stride_qt + heads[:, None] * stride_qh + offs_d[None, :],
        mask=mask_g[:, None] & mask_d[None, :],
        other=0.0,
    )

    first = 0
    if HAS_WINDOW:
        first = tl.maximum(ctx - window, 0)  # the query sits at position ctx - 1 and sees the last `window` keys
    # Splits partition the visible keys [first, ctx) in whole key tiles, at least min_split keys each; the
    # splits past the end see no key.
    split_len = tl.cdiv(tl.cdiv(ctx - first, num_splits), BLOCK_N) * BLOCK_N
    split_len = tl.maximum(split_len, min_split)
    lo = first + split * split_len
    hi = tl.minimum(lo + split_len, ctx)
    table = block_tables_ptr + seq.to(tl.int64) * stride_bt
    m_i = tl.full([BLOCK_G], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_G], dtype=tl.float32)
    acc = tl.zeros([BLOCK_G, BLOCK_D], dtype=tl.float32)
    qk_scale = scale * 1.4426950408889634  # log2(e): the softmax runs on exp2
    for start_n in range(lo, hi, BLOCK_N):
        cols = start_n + offs_n
        mask_n = cols < hi
        # Key j lives in block table[j // block_size] at offset j % block_size.
        blocks = tl.load(table + cols // block_size, mask=mask_n, other=0).to(tl.int64)
        rows = blocks * stride_cb + (cols % block_size) * stride_co + kv_head * stride_ch
        kt = tl.load(k_cache_ptr + rows[None, :] + offs_d[:, None], mask=mask_n[None, :] & mask_d[:, None], other=0.0)
        # An int8 cache's values are exact in q's dtype; the per-key scales multiply the product's columns.
        qk = tl.dot(q, kt.to(q.dtype), input_precision=INPUT_PRECISION) * qk_scale
        if KV_QUANT:
            s_rows = blocks * stride_sb + (cols % block_size) * stride_so + kv_head * stride_sh
            qk = qk * tl.load(k_scale_ptr + s_rows, mask=mask_n, other=0.0)[None, :]
        qk = tl.where(mask_n[None, :], qk, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(qk, 1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        p = tl.math.exp2(qk - m_safe[:, None])
        alpha = tl.math.exp2(m_i - m_safe)
        l_i = l_i * alpha + tl.sum(p, 1)
        v = tl.load(v_cache_ptr + rows[:, None] + offs_d[None, :], mask=mask_n[:, None] & mask_d[None, :], other=0.0)
        if KV_QUANT:
            p = p * tl.load(v_scale_ptr + s_rows, mask=mask_n, other=0.0)[None, :]  # V's scales, after l_i
        acc = acc * alpha[:, None]
        acc = tl.dot(p.to(q.dtype), v.to(q.dtype), acc, input_precision=INPUT_PRECISION)
        m_i = m_new

    # A split with no visible key writes out 0 and lse -inf, so it gets weight 0 in the merge.
    out = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]
    lse = tl.where(l_i == 0.0, float("-inf"), m_i + tl.math.log2(tl.where(l_i == 0.0, 1.0, l_i)))
    tl.store(
        part_o_ptr + q_row * stride_pt + heads[:, None] * stride_ph + split * stride_ps + offs_d[None, :],
        out,
        mask=mask_g[:, None] & mask_d[None, :],
    )
    tl.store(part_lse_ptr + q_row * stride_lt + heads * stride_lh + split, lse, mask=mask_g)
