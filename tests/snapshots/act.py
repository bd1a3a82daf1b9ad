# kiln generated Triton kernel (template codegen/templates/act.py.j2); do not edit
# family: act
# kernel: act_kernel
# op: gated_act
# tile: BLOCK_SIZE=1024 num_warps=4
# params: ACT='silu' GATED=True
import triton
import triton.language as tl


@triton.jit
def act_kernel(
    gate_ptr, up_ptr, out_ptr,
    n_elements,
    ACT: tl.constexpr,
    GATED: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
):
    # Elementwise over flat contiguous tensors: out = act(gate) * up, or act(gate) when not GATED.
    pid = tl.program_id(0).to(tl.int64)
    offs = pid * BLOCK_SIZE + tl.arange(0, BLOCK_SIZE)
    mask = offs < n_elements
    g_in = tl.load(gate_ptr + offs, mask=mask, other=0.0)
    g = g_in.to(tl.float32)
    if ACT == "silu":
        a = g * tl.sigmoid(g)
    elif ACT == "gelu":
        a = 0.5 * g * (1.0 + tl.math.erf(g * 0.7071067811865476))
    elif ACT == "gelu_tanh":
        # tanh from exp (every backend has it); exp(-2|z|) <= 1 cannot overflow.
        z = 0.7978845608028654 * (g + 0.044715 * g * g * g)
        e = tl.exp(-2.0 * tl.abs(z))
        tanh_abs = (1.0 - e) / (1.0 + e)
        a = 0.5 * g * (1.0 + tl.where(z >= 0, tanh_abs, -tanh_abs))
    else:
        a = tl.maximum(g, 0.0)
    # Round to the activation dtype before the product, as the unfused act(gate) * up does; the product
    # itself runs in fp32 and is rounded once on store, which is what a bf16/fp16 multiply does.
    y = a.to(g_in.dtype).to(tl.float32)
    if GATED:
        y = y * tl.load(up_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + offs, y.to(out_ptr.dtype.element_ty), mask=mask)
