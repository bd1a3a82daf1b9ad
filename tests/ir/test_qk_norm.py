"""kiln::head_rms_norm (Qwen3's q/k norm) and the frontend's attention(qk_norm = rms)."""

from __future__ import annotations

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from kiln.errors import KilnError
from kiln.ir.frontend import build_graph, random_weights
from kiln.reference import forward_logits
from kiln.spec.loader import load_spec

ops = torch.ops.kiln


def _per_head(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    """HF's Qwen3RMSNorm on x.view(..., heads, D), in float64: normalize in fp32 order, cast back, then scale."""
    d = w.shape[0]
    h = x.double().view(*x.shape[:-1], -1, d)
    normed = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return (w.double() * normed).reshape(x.shape)


@pytest.mark.parametrize(("heads", "d"), [(1, 8), (3, 24), (4, 128)])
def test_head_rms_norm_normalizes_each_head_with_the_shared_weight(heads, d):
    g = torch.Generator().manual_seed(heads * d)
    fused = torch.randn(2, 5, 3 * heads * d, generator=g) * 4 + 1
    x = fused[..., heads * d : 2 * heads * d]  # a strided piece, as after gqa_fusion
    w = torch.rand(d, generator=g) + 0.5
    got = ops.head_rms_norm(x, w, 1e-6)
    torch.testing.assert_close(got.double(), _per_head(x, w, 1e-6), rtol=1e-5, atol=1e-5)
    # Each head is normalized on its own: scaling one head leaves every head's output as it was.
    scaled = x.clone()
    scaled[..., :d] *= 7
    torch.testing.assert_close(ops.head_rms_norm(scaled, w, 1e-6), got, rtol=1e-5, atol=1e-5)
    with FakeTensorMode() as mode:
        fake = ops.head_rms_norm(mode.from_tensor(x), mode.from_tensor(w), 1e-6)
    assert fake.shape == x.shape and fake.is_contiguous()


def test_head_rms_norm_rounds_like_hf_in_bf16():
    g = torch.Generator().manual_seed(1)
    x, w = torch.randn(1, 3, 4 * 16, generator=g).bfloat16(), (torch.rand(16, generator=g) + 0.5).bfloat16()
    xf = x.float().view(1, 3, 4, 16)
    hf = w * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + 1e-6)).to(torch.bfloat16)
    assert torch.equal(ops.head_rms_norm(x, w, 1e-6), hf.reshape(x.shape))


def test_head_rms_norm_refuses_partial_heads():
    with pytest.raises(KilnError, match="whole heads"):
        ops.head_rms_norm(torch.randn(1, 2, 40), torch.ones(16), 1e-6)


def test_frontend_normalizes_q_and_k_per_head_before_rope():
    cfg = load_spec("tiny-qwen3").model
    gm = build_graph(cfg)
    norms = [n for n in gm.graph.nodes if n.target == ops.head_rms_norm.default]
    assert [n.name for n in norms[:2]] == ["layers_0_attn0_q_norm", "layers_0_attn0_k_norm"]
    assert len(norms) == 2 * cfg.layers
    for n in norms:
        proj, weight, eps = n.args
        assert proj.target == ops.linear.default and weight.target == n.name.replace("_", ".", 3) + ".weight"
        assert eps == cfg.norm.eps and [u.target for u in n.users] == [ops.rope.default]
        assert tuple(n.meta["val"].shape) == tuple(proj.meta["val"].shape)
    q_width = cfg.heads * cfg.head_dim
    assert q_width != cfg.dim and norms[0].meta["val"].shape[-1] == q_width  # explicit head_dim: 4 x 32, dim 64


def test_the_q_and_k_norm_weights_change_the_logits():
    """Each weight is read where the spec says: perturbing q_norm, then k_norm, of one layer moves the logits."""
    cfg = load_spec("tiny-qwen3").model
    weights = random_weights(cfg, seed=3)
    ids = torch.randint(0, cfg.vocab, (2, 9), generator=torch.Generator().manual_seed(0))
    base = forward_logits(build_graph(cfg, weights), ids)
    for name in ("layers.1.attn0.q_norm.weight", "layers.1.attn0.k_norm.weight"):
        changed = dict(weights)
        changed[name] = weights[name] * torch.linspace(0.5, 1.5, cfg.head_dim)
        assert not torch.allclose(forward_logits(build_graph(cfg, changed), ids), base, atol=1e-4)
    # And the norm itself is applied (with unit weights it is not the identity).
    kept = {k: v for k, v in weights.items() if not k.endswith((".q_norm.weight", ".k_norm.weight"))}
    plain = build_graph(_without_qk_norm(cfg), kept)
    assert not torch.allclose(forward_logits(plain, ids), base, atol=1e-4)


def _without_qk_norm(cfg):
    import dataclasses

    from kiln.model_config import Add, AttentionCall

    body = tuple(dataclasses.replace(s, value=Add(s.value.left, dataclasses.replace(s.value.right, qk_norm=None)))
                 if isinstance(s.value.right, AttentionCall) else s for s in cfg.body)
    return dataclasses.replace(cfg, body=body)
