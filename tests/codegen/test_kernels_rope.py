"""The rotary kernel (codegen/templates/rope.py.j2) against kiln's reference rope."""


import pytest
import torch

from kiln.errors import CodegenError
from kiln.ir import ops
from tests.support.rope import llama3_inv_freq


@pytest.mark.parametrize(
    ("b", "t", "heads", "head_dim"),
    [(1, 1, 2, 64), (2, 17, 3, 64), (1, 17, 4, 128), (2, 1, 3, 128), (1, 17, 2, 80)],
)
def test_rope_matches_reference(b, t, heads, head_dim):
    from kiln.codegen.rope import rope

    torch.manual_seed(t * 100 + heads * 10 + head_dim)
    x = torch.randn(b, t, heads * head_dim)
    positions = torch.randint(0, 4096, (b, t))
    inv_freq = llama3_inv_freq(head_dim)
    out = torch.full_like(x, float("nan"))
    got = rope(x, positions, inv_freq, out=out)
    assert got is out
    torch.testing.assert_close(got, ops.rope(x, positions, inv_freq), rtol=1e-5, atol=1e-5)


def test_rope_in_place_on_a_fused_qkv_slice():
    from kiln.codegen.rope import rope

    torch.manual_seed(5)
    heads, kv_heads, d, t = 4, 2, 64, 17
    qkv = torch.randn(2, t, (heads + 2 * kv_heads) * d)
    k = qkv[..., heads * d : (heads + kv_heads) * d]  # strided view into the fused projection
    positions = torch.arange(t).repeat(2, 1) + 30
    inv_freq = llama3_inv_freq(d)
    ref_k = ops.rope(k.contiguous(), positions, inv_freq)
    before = qkv.clone()
    assert rope(k, positions, inv_freq, out=k) is k
    torch.testing.assert_close(k, ref_k, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(qkv[..., : heads * d], before[..., : heads * d], rtol=0, atol=0)
    torch.testing.assert_close(
        qkv[..., (heads + kv_heads) * d :], before[..., (heads + kv_heads) * d :], rtol=0, atol=0
    )


def test_rope_bf16_close():
    from kiln.codegen.rope import rope

    torch.manual_seed(6)
    x = torch.randn(1, 5, 2 * 64, dtype=torch.bfloat16)
    positions = torch.randint(0, 100, (1, 5))
    inv_freq = llama3_inv_freq(64)
    torch.testing.assert_close(rope(x, positions, inv_freq), ops.rope(x, positions, inv_freq), rtol=2e-2, atol=2e-2)


def test_rope_rejects_bad_inputs():
    from kiln.codegen.rope import rope

    x = torch.randn(1, 3, 128)
    with pytest.raises(CodegenError, match="head_dim"):
        rope(x, torch.zeros(1, 3, dtype=torch.int64), torch.ones(24))
    with pytest.raises(CodegenError, match="positions has shape"):
        rope(x, torch.zeros(1, 4, dtype=torch.int64), torch.ones(32))
    with pytest.raises(CodegenError, match="positions has dtype"):
        rope(x, torch.zeros(1, 3), torch.ones(32))
