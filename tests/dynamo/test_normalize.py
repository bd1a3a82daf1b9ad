"""kiln.dynamo.normalize on Dynamo graphs of small modules: what is claimed, what is refused and why, and that the
normalized graph (kiln ops on their reference implementations) still computes what eager torch does."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from kiln.dynamo.masks import MaskOracle, infer_spec
from kiln.dynamo.rules import normalize


@pytest.fixture(autouse=True)
def fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def normalized(fn, *inputs):
    """(normalizer, eager result, normalized-graph result) for fn's single Dynamo graph."""
    seen = []

    def capture(gm, example_inputs):
        seen.append((gm, list(example_inputs)))
        return gm.forward

    with torch.no_grad():
        want = torch.compile(fn, backend=capture, fullgraph=True, dynamic=False)(*inputs)
        ((gm, example),) = seen
        nz = normalize(gm, MaskOracle(gm, example).spec)
        got = gm(*example)
    return nz, want, got[0] if isinstance(got, (tuple, list)) else got


def claimed(nz) -> dict[str, int]:
    out: dict[str, int] = {}
    for c in nz.claims:
        out[c.op] = out.get(c.op, 0) + 1
    return out


def rms(x, w, eps=1e-6):
    h = x.to(torch.float32)
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return w * h.to(x.dtype)


def test_rms_norm_is_claimed_with_the_residual_add():
    x, r, w = torch.randn(2, 3, 16), torch.randn(2, 3, 16), torch.randn(16)
    nz, want, got = normalized(lambda x, r, w: rms(x + r, w), x, r, w)
    assert claimed(nz) == {"rms_norm": 1, "add": 1}
    torch.testing.assert_close(got, want)


def test_rms_norm_with_promoting_weight_is_refused():
    x, w = torch.randn(2, 3, 16, dtype=torch.bfloat16), torch.randn(16)  # fp32 weight * bf16 -> fp32 output
    nz, want, got = normalized(rms, x, w)
    assert claimed(nz) == {}
    assert [r.pattern for r in nz.rejections] == ["rms_norm"] and "promotes" in nz.rejections[0].reason
    torch.testing.assert_close(got, want)


def rope_attention(q, k, v, pos, inv, scaling=1.0, mask=None):
    """HF's rotary embedding (rotate-half) and eager attention with repeat_kv, on [B, H, T, D] heads."""
    freqs = pos[..., None].float() * inv.float()
    emb = torch.cat((freqs, freqs), dim=-1)
    cos, sin = (emb.cos() * scaling).to(q.dtype).unsqueeze(1), (emb.sin() * scaling).to(q.dtype).unsqueeze(1)

    def rot(x):
        x1, x2 = x[..., : x.shape[-1] // 2], x[..., x.shape[-1] // 2 :]
        return torch.cat((-x2, x1), dim=-1)

    q, k = q * cos + rot(q) * sin, k * cos + rot(k) * sin
    b, hkv, s, d = k.shape
    rep = q.shape[1] // hkv
    k = k[:, :, None, :, :].expand(b, hkv, rep, s, d).reshape(b, hkv * rep, s, d)
    v = v[:, :, None, :, :].expand(b, hkv, rep, s, d).reshape(b, hkv * rep, s, d)
    w = torch.matmul(q, k.transpose(2, 3)) / math.sqrt(d)
    if mask is not None:
        w = w + mask
    p = F.softmax(w, dim=-1, dtype=torch.float32).to(q.dtype)
    return torch.matmul(p, v).transpose(1, 2).reshape(q.shape[0], q.shape[2], -1)


def heads(t=6):
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, h, t, 8, generator=g) for h in (4, 2, 2))
    pos = torch.arange(t)[None].expand(2, t)
    inv = 1.0 / (10000 ** (torch.arange(0, 8, 2).float() / 8))
    return q, k, v, pos, inv


def causal_bias(t, s, window=0):
    i, j = torch.arange(t)[:, None] + (s - t), torch.arange(s)[None, :]
    ok = (j <= i) & ((i - j < window) if window else True)
    return torch.zeros(t, s).masked_fill(~ok, torch.finfo(torch.float32).min)[None, None]


@pytest.mark.parametrize("window", [0, 3])
def test_rope_and_gqa_attention_with_a_causal_or_window_mask(window):
    q, k, v, pos, inv = heads()
    mask = causal_bias(6, 6, window)
    nz, want, got = normalized(lambda *a: rope_attention(*a, mask=mask), q, k, v, pos, inv)
    assert claimed(nz) == {"rope": 2, "attention": 1}
    assert list(nz.masks.values()) == [(True, window)]
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


def test_rope_with_attention_scaling_and_attention_with_a_bias_are_refused():
    q, k, v, pos, inv = heads()
    bias = torch.randn(1, 1, 6, 6)
    nz, want, got = normalized(lambda *a: rope_attention(*a, scaling=0.9, mask=bias), q, k, v, pos, inv)
    assert claimed(nz) == {}
    assert any("additive bias" in r.reason for r in nz.rejections)
    torch.testing.assert_close(got, want)


def test_sdpa_forms():
    q, k, v, _, _ = heads()
    nz, want, got = normalized(
        lambda q, k, v: F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True), q, k, v
    )
    assert claimed(nz) == {"attention": 1}
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    # is_causal with fewer queries than keys: sdpa aligns top-left, kiln bottom-right -> refused
    nz, want, got = normalized(
        lambda q, k, v: F.scaled_dot_product_attention(q[:, :, :2], k, v, is_causal=True, enable_gqa=True), q, k, v
    )
    assert claimed(nz) == {} and "is_causal" in nz.rejections[0].reason
    # dropout is not a kiln attention
    nz, _, _ = normalized(
        lambda q, k, v: F.scaled_dot_product_attention(q, k, v, dropout_p=0.5, enable_gqa=True), q, k, v
    )
    assert claimed(nz) == {} and "dropout" in nz.rejections[0].reason


def gelu_new(x):
    return 0.5 * x * (1.0 + torch.tanh(math.sqrt(2.0 / math.pi) * (x + 0.044715 * torch.pow(x, 3.0))))


def test_mlps():
    x, g, u = torch.randn(2, 3, 8), torch.randn(16, 8), torch.randn(16, 8)
    nz, want, got = normalized(lambda x: F.silu(F.linear(x, g)) * F.linear(x, u), x)
    assert claimed(nz) == {"linear": 2, "gated_act": 1}
    torch.testing.assert_close(got, want)
    nz, want, got = normalized(gelu_new, x)
    assert claimed(nz) == {"act": 1} and nz.claims[0].detail == "gelu_tanh"
    torch.testing.assert_close(got, want)
    nz, want, got = normalized(lambda x: F.layer_norm(x, (8,), torch.ones(8), torch.zeros(8)), x)
    assert claimed(nz) == {"layer_norm": 1}
    torch.testing.assert_close(got, want)


def test_infer_spec():
    assert infer_spec(causal_bias(5, 5)) == (True, 0)
    assert infer_spec(causal_bias(1, 9, window=4)) == (True, 4)
    assert infer_spec(torch.ones(1, 1, 4, 4, dtype=torch.bool)) == (False, 0)
    padded = causal_bias(4, 4).expand(2, 1, 4, 4).clone()
    padded[0, ..., 0] = torch.finfo(torch.float32).min
    assert "padding" in infer_spec(padded)


def rope(q, pos, inv):
    """rope_attention's rotary embedding alone."""
    freqs = pos[..., None].float() * inv.float()
    emb = torch.cat((freqs, freqs), dim=-1)
    cos, sin = emb.cos().to(q.dtype).unsqueeze(1), emb.sin().to(q.dtype).unsqueeze(1)
    x1, x2 = q[..., : q.shape[-1] // 2], q[..., q.shape[-1] // 2 :]
    return q * cos + torch.cat((-x2, x1), dim=-1) * sin


def test_claimed_outputs_keep_the_strides_of_the_ops_they_replace():
    """kiln computes flat [B, T, H * D]: its [B, H, T, D] view has other strides than a contiguous sdpa / rope
    output, and a .view of that output (which only works on the right strides) must still work."""
    q, k, v, pos, inv = heads()
    as_rows = {
        "attention": lambda q, k, v: F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True),
        "rope": lambda q, k, v: rope(q, pos, inv),
    }
    for op, fn in as_rows.items():
        assert fn(q, k, v).is_contiguous()
        nz, want, got = normalized(lambda q, k, v, fn=fn: fn(q, k, v).view(2, -1), q, k, v)
        assert claimed(nz) == {op: 1}
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


def test_claimed_outputs_keep_an_uncommon_layout():
    q = torch.randn(4, 2, 6, 8).permute(1, 0, 2, 3)  # sdpa's output follows q's memory order
    nz, want, got = normalized(lambda q: F.scaled_dot_product_attention(q, q, q, is_causal=True), q)
    assert claimed(nz) == {"attention": 1}
    assert got.stride() == want.stride() == (48, 96, 8, 1)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


def test_an_empty_cat_that_promotes_is_not_the_same_value():
    # cat([empty fp32, k]) is an fp32 copy of a bf16 k (in cat's contiguous layout, whatever k's strides)
    k = torch.randn(2, 6, 2, 8, dtype=torch.bfloat16).transpose(1, 2)
    nz, want, got = normalized(lambda k: torch.cat([torch.tensor([]), k], dim=-2), k)
    assert want.dtype == got.dtype == torch.float32 and got.stride() == want.stride()
    torch.testing.assert_close(got, want)


def test_no_copy_where_the_strides_already_agree():
    # HF's layout: q projected as [B, T, H * D], viewed as heads and transposed; rope then keeps that layout
    x, (_, _, _, pos, inv) = torch.randn(2, 6, 32), heads()

    def fn(x):
        q = x.view(2, 6, 4, 8).transpose(1, 2)
        out = rope(q, pos, inv)
        return out.transpose(1, 2).reshape(2, 6, 32)

    nz, want, got = normalized(fn, x)
    assert claimed(nz) == {"rope": 1}
    assert not [n for n in nz.gm.graph.nodes if n.target in ("contiguous", "permute")]
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize(("source", "site"), [
    ("L['self'].model.layers.0.self_attn", "model.layers.0.self_attn"),
    ("L['args'][0].model.layers.1.mlp", "model.layers.1.mlp"),  # forward wrapped to take the module by *args
    ("L['self']", "<root>"),
])
def test_a_site_is_the_module_path_without_dynamos_source_of_the_root(source, site):
    from torch import fx

    from kiln.dynamo.fx_query import site_of

    node = fx.Graph().placeholder("x")
    node.meta["nn_module_stack"] = {"k": (source, torch.nn.Module)}
    assert site_of(node) == site
