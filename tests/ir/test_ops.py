"""The Level-1 ops against independent formulations, and their fake kernels."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from torch._subclasses.fake_tensor import FakeTensorMode

import kiln.ir.ops  # noqa: F401  (registers torch.ops.kiln.*)
from kiln.errors import KilnError

ops = torch.ops.kiln


def _gen(seed: int = 0) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _sdpa_reference(q, k, v, heads, kv_heads, mask):
    """torch's SDPA with GQA on [B, T, H * D] inputs; mask is a bool [T, S] (True = attend) or None."""
    b, t, _ = q.shape
    s, d = k.shape[1], q.shape[2] // heads
    qh = q.view(b, t, heads, d).transpose(1, 2)
    kh = k.view(b, s, kv_heads, d).transpose(1, 2)
    vh = v.view(b, s, kv_heads, d).transpose(1, 2)
    out = F.scaled_dot_product_attention(qh, kh, vh, attn_mask=mask, enable_gqa=True)
    return out.transpose(1, 2).reshape(b, t, heads * d)


def _loop_reference(q, k, v, heads, kv_heads, causal, window, scale):
    """One query and one head at a time, with the visible key range spelled out explicitly."""
    b, t, _ = q.shape
    s, d = k.shape[1], q.shape[2] // heads
    out = torch.zeros(b, t, heads, d, dtype=torch.float64)
    qh, kh, vh = (z.double().view(b, z.shape[1], -1, d) for z in (q, k, v))
    for i in range(t):
        pos = i + (s - t)  # queries sit at the end of the keys
        lo, hi = 0, (pos + 1 if causal else s)
        if window > 0:
            lo = max(0, pos - window + 1)
            if not causal:
                hi = min(s, pos + window)
        for h in range(heads):
            kv = h // (heads // kv_heads)
            scores = (kh[:, lo:hi, kv] @ qh[:, i, h, :, None]).squeeze(-1) * scale
            out[:, i, h] = (scores.softmax(-1)[:, None, :] @ vh[:, lo:hi, kv]).squeeze(1)
    return out.reshape(b, t, heads * d)


@pytest.mark.parametrize(("heads", "kv_heads", "t", "s"), [(4, 4, 5, 5), (8, 2, 7, 7), (8, 1, 3, 11), (4, 2, 1, 9)])
def test_attention_matches_sdpa_causal_and_full(heads, kv_heads, t, s):
    d, g = 16, _gen(1)
    q = torch.randn(2, t, heads * d, generator=g)
    k, v = (torch.randn(2, s, kv_heads * d, generator=g) for _ in range(2))
    # causal with S > T: query i sees keys up to i + (S - T), an explicit mask for SDPA
    mask = torch.arange(s)[None, :] <= torch.arange(t)[:, None] + (s - t)
    got = ops.attention(q, k, v, heads, kv_heads, True, 0, d**-0.5)
    torch.testing.assert_close(got, _sdpa_reference(q, k, v, heads, kv_heads, mask), atol=1e-5, rtol=1e-5)
    got = ops.attention(q, k, v, heads, kv_heads, False, 0, d**-0.5)
    torch.testing.assert_close(got, _sdpa_reference(q, k, v, heads, kv_heads, None), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize(
    ("causal", "window", "t", "s"),
    [(True, 3, 9, 9), (True, 1, 4, 4), (True, 4, 3, 10), (False, 2, 6, 6), (True, 100, 5, 5)],
)
def test_attention_window_matches_loop(causal, window, t, s):
    heads, kv_heads, d, g = 4, 2, 8, _gen(2)
    q = torch.randn(1, t, heads * d, generator=g)
    k, v = (torch.randn(1, s, kv_heads * d, generator=g) for _ in range(2))
    scale = 0.3
    got = ops.attention(q, k, v, heads, kv_heads, causal, window, scale)
    want = _loop_reference(q, k, v, heads, kv_heads, causal, window, scale)
    torch.testing.assert_close(got.double(), want, atol=1e-5, rtol=1e-5)


def test_attention_window_one_returns_own_value():
    # window 1 + causal: each query sees only itself, so the output is v (heads mapped to their kv head)
    q, k, v = (torch.randn(1, 5, 2 * 4, generator=_gen(i)) for i in range(3))
    got = ops.attention(q, k, v, 2, 2, True, 1, 1.0)
    torch.testing.assert_close(got, v)


def test_rms_norm_matches_manual():
    x, w = torch.randn(2, 3, 32, generator=_gen(3)), torch.randn(32, generator=_gen(4))
    want = w * x / torch.sqrt((x * x).sum(-1, keepdim=True) / 32 + 1e-6)
    torch.testing.assert_close(ops.rms_norm(x, w, 1e-6), want)
    # bf16 input: computed in fp32, returned in bf16
    out = ops.rms_norm(x.bfloat16(), w.bfloat16(), 1e-6)
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out.float(), want, atol=5e-2, rtol=2e-2)


def test_layer_norm_matches_manual():
    x, w, b = torch.randn(2, 5, 24, generator=_gen(5)), torch.randn(24, generator=_gen(6)), torch.randn(24)
    mu = x.mean(-1, keepdim=True)
    var = ((x - mu) ** 2).mean(-1, keepdim=True)
    torch.testing.assert_close(ops.layer_norm(x, w, b, 1e-5), (x - mu) / torch.sqrt(var + 1e-5) * w + b)


def test_rope_matches_complex_rotation():
    b, t, heads, d = 2, 6, 3, 16
    x = torch.randn(b, t, heads * d, generator=_gen(7))
    positions = torch.randint(0, 1000, (b, t), generator=_gen(8))
    inv_freq = 1.0 / (10000 ** (torch.arange(0, d, 2).double() / d))
    # rotate-half pairs element j with j + d/2: treat them as the real and imaginary part of one complex number
    xh = x.double().view(b, t, heads, d)
    z = torch.complex(xh[..., : d // 2], xh[..., d // 2 :])
    angle = positions.double()[..., None, None] * inv_freq
    rotated = z * torch.polar(torch.ones_like(angle), angle)
    want = torch.cat((rotated.real, rotated.imag), dim=-1).reshape(b, t, heads * d)
    got = ops.rope(x, positions, inv_freq.float())
    torch.testing.assert_close(got.double(), want, atol=1e-3, rtol=1e-4)  # fp32 angles at positions up to 1000
    # position 0 is the identity
    torch.testing.assert_close(ops.rope(x, torch.zeros(b, t, dtype=torch.long), inv_freq.float()), x)


def test_linear_embedding_add():
    x, w, bias = torch.randn(3, 4, 8), torch.randn(5, 8), torch.randn(5)
    torch.testing.assert_close(ops.linear(x, w, bias), x @ w.T + bias)
    torch.testing.assert_close(ops.linear(x, w, None), x @ w.T)
    table, ids = torch.randn(10, 6), torch.tensor([[3, 0, 9], [1, 1, 2]])
    torch.testing.assert_close(ops.embedding(table, ids), table[ids])
    torch.testing.assert_close(ops.add(x, x), 2 * x)


@pytest.mark.parametrize(
    ("kind", "formula"),
    [
        ("silu", lambda x: x / (1 + torch.exp(-x))),
        ("relu", lambda x: x.clamp(min=0)),
        ("gelu", lambda x: 0.5 * x * (1 + torch.erf(x / math.sqrt(2)))),
        ("gelu_tanh", lambda x: 0.5 * x * (1 + torch.tanh(math.sqrt(2 / math.pi) * (x + 0.044715 * x**3)))),
    ],
)
def test_activations_match_formulas(kind, formula):
    x, up = torch.randn(2, 3, 16, generator=_gen(9)), torch.randn(2, 3, 16, generator=_gen(10))
    torch.testing.assert_close(ops.act(x, kind), formula(x))
    torch.testing.assert_close(ops.gated_act(x, up, kind), formula(x) * up)


def test_unknown_activation_is_rejected():
    with pytest.raises(KilnError, match="unknown activation"):
        ops.act(torch.randn(3), "swish")


def _op_cases():
    d, g = 8, _gen(11)
    q, k = torch.randn(2, 5, 4 * d, generator=g), torch.randn(2, 7, 2 * d, generator=g)
    pos = torch.arange(5).expand(2, 5).contiguous()
    x, w = torch.randn(2, 5, 16, generator=g), torch.randn(16)
    return [
        (ops.embedding.default, (torch.randn(11, 16), pos), (2, 5, 16)),
        (ops.rms_norm.default, (x, w, 1e-5), (2, 5, 16)),
        (ops.layer_norm.default, (x, w, torch.zeros(16), 1e-5), (2, 5, 16)),
        (ops.linear.default, (x, torch.randn(3, 16), torch.randn(3)), (2, 5, 3)),
        (ops.linear.default, (x, torch.randn(3, 16), None), (2, 5, 3)),
        (ops.rope.default, (q, pos, torch.rand(d // 2)), (2, 5, 4 * d)),
        (ops.attention.default, (q, k, k.clone(), 4, 2, True, 3, 0.5), (2, 5, 4 * d)),
        (ops.act.default, (x, "gelu"), (2, 5, 16)),
        (ops.gated_act.default, (x, x.clone(), "silu"), (2, 5, 16)),
        (ops.add.default, (x, x.clone()), (2, 5, 16)),
    ]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fake_kernels_shapes_and_dtypes(dtype):
    for op, args, shape in _op_cases():
        args = tuple(a.to(dtype) if isinstance(a, torch.Tensor) and a.is_floating_point() else a for a in args)
        real = op(*args)
        with FakeTensorMode(allow_non_fake_inputs=True):
            fake = op(*args)
        assert tuple(fake.shape) == shape == tuple(real.shape), op
        assert fake.dtype == real.dtype == dtype, op
        assert fake.stride() == real.stride(), op


@pytest.mark.parametrize("case", range(10))
def test_opcheck(case):
    op, args, _ = _op_cases()[case]
    torch.library.opcheck(op, args, test_utils=("test_schema", "test_faketensor"))
