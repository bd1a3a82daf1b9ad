# kiln generated Triton kernel (template codegen/templates/paged_merge.py.j2); do not edit
# family: paged_merge
# kernel: paged_merge_kernel
# op: split_kv_merge
# tile: BLOCK_D=128 BLOCK_S=8 num_warps=4
# params: -
import triton
import triton.language as tl


@triton.jit
def paged_merge_kernel(
    part_o_ptr, part_lse_ptr, o_ptr,
    stride_pt, stride_ph, stride_ps,
    stride_lt, stride_lh,
    stride_ot, stride_oh,
    num_splits, HEAD_DIM,
    BLOCK_S: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    # Split-KV merge: program (token, head) combines the per-split partial outputs, each normalized over its
    # own keys, weighted by exp2(lse_split - lse_max) (lse in log2 units, as the split kernel writes it).
    tok = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    offs_s = tl.arange(0, BLOCK_S)
    offs_d = tl.arange(0, BLOCK_D)
    mask_s = offs_s < num_splits
    mask_d = offs_d < HEAD_DIM
    lse = tl.load(part_lse_ptr + tok * stride_lt + head * stride_lh + offs_s, mask=mask_s, other=float("-inf"))
    m = tl.max(lse, 0)
    m_safe = tl.where(m == float("-inf"), 0.0, m)  # no split saw a key: every weight is exp2(-inf) = 0
    w = tl.math.exp2(lse - m_safe)
    part = tl.load(
        part_o_ptr + tok * stride_pt + head * stride_ph + offs_s[:, None] * stride_ps + offs_d[None, :],
        mask=mask_s[:, None] & mask_d[None, :],
        other=0.0,
    )
    total = tl.sum(w, 0)
    out = tl.sum(part * w[:, None], 0) / tl.where(total == 0.0, 1.0, total)
    tl.store(o_ptr + tok * stride_ot + head * stride_oh + offs_d, out.to(o_ptr.dtype.element_ty), mask=mask_d)
