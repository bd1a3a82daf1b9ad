"""kiln's Level-1 op set: `torch.ops.kiln.*`, each with a reference implementation in plain torch.

The reference implementations are the oracle every kernel and pass is checked against. Each op also has
a fake kernel so FakeTensor propagation can fill node.meta["val"] without computing anything.

Layout conventions (no reshapes in the Level-1 graph):
- activations are [batch, seq, features]; attention inputs and outputs are flat [batch, seq, heads * head_dim]
- positions are int64 [batch, seq]
- reductions and softmax run in fp32; results come back in the input dtype
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from kiln.errors import KilnError
from kiln.ir.registry import kiln_op, reference
from kiln.ir.signatures import ATTENTION

_ACTS = ("silu", "gelu", "gelu_tanh", "relu")


def _act(x: torch.Tensor, kind: str) -> torch.Tensor:
    if kind == "silu":
        return F.silu(x)
    if kind == "gelu":
        return F.gelu(x)
    if kind == "gelu_tanh":
        return F.gelu(x, approximate="tanh")
    if kind == "relu":
        return F.relu(x)
    raise KilnError(f"unknown activation {kind!r}; expected one of {_ACTS}")


@kiln_op("kiln::embedding", mutates_args=())
def embedding(weight: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    return F.embedding(ids, weight)


@embedding.register_fake
def _(weight, ids):
    return weight.new_empty((*ids.shape, weight.shape[1]))


@kiln_op("kiln::rms_norm", mutates_args=())
def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    xf = x.float()
    normed = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    # HF order: normalize in fp32, cast back, then scale (bitwise-relevant in bf16).
    return weight.to(x.dtype) * normed.to(x.dtype)


@rms_norm.register_fake
def _(x, weight, eps):
    return torch.empty_like(x)


@kiln_op("kiln::head_rms_norm", mutates_args=())
def head_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """rms_norm over each head of flat heads: x [..., H * D], weight [D] shared by every head (Qwen3's q/k norm)."""
    d = weight.shape[0]
    if x.shape[-1] % d:
        raise KilnError(f"head_rms_norm: {x.shape[-1]} features are not whole heads of {d}")
    heads = x.view(*x.shape[:-1], x.shape[-1] // d, d)
    return reference("rms_norm")(heads, weight, eps).reshape(x.shape)


@head_rms_norm.register_fake
def _(x, weight, eps):
    return torch.empty_like(x, memory_format=torch.contiguous_format)


@kiln_op("kiln::layer_norm", mutates_args=())
def layer_norm(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, eps: float) -> torch.Tensor:
    return F.layer_norm(x.float(), (x.shape[-1],), weight.float(), bias.float(), eps).to(x.dtype)


@layer_norm.register_fake
def _(x, weight, bias, eps):
    return torch.empty_like(x)


@kiln_op("kiln::linear", mutates_args=())
def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    return F.linear(x, weight, bias)


@linear.register_fake
def _(x, weight, bias):
    return x.new_empty((*x.shape[:-1], weight.shape[0]))


def rope_cos_sin(positions: torch.Tensor, inv_freq: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin tables [*positions.shape, head_dim] in fp32 for the rotate-half form."""
    freqs = positions.to(torch.float32)[..., None] * inv_freq.to(torch.float32)
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos(), emb.sin()


@kiln_op("kiln::rope", mutates_args=())
def rope(x: torch.Tensor, positions: torch.Tensor, inv_freq: torch.Tensor) -> torch.Tensor:
    """Rotary embedding (rotate-half form) on flat heads: x [B, T, H * D], positions [B, T], inv_freq [D / 2]."""
    head_dim = 2 * inv_freq.shape[0]
    b, t, hd = x.shape
    xh = x.view(b, t, hd // head_dim, head_dim)
    cos, sin = rope_cos_sin(positions, inv_freq)
    cos, sin = cos[:, :, None, :].to(x.dtype), sin[:, :, None, :].to(x.dtype)
    x1, x2 = xh[..., : head_dim // 2], xh[..., head_dim // 2 :]
    rotated = torch.cat((-x2, x1), dim=-1)
    return (xh * cos + rotated * sin).reshape(b, t, hd)


@rope.register_fake
def _(x, positions, inv_freq):
    return torch.empty_like(x)


def attention_mask(q_len: int, k_len: int, causal: bool, window: int, device: torch.device) -> torch.Tensor | None:
    """Boolean [q_len, k_len] mask (True = attend), queries aligned to the end of the keys; None = all."""
    if not causal and window <= 0:
        return None
    i = torch.arange(q_len, device=device)[:, None] + (k_len - q_len)
    j = torch.arange(k_len, device=device)[None, :]
    mask = torch.ones(q_len, k_len, dtype=torch.bool, device=device)
    if causal:
        mask &= j <= i
    if window > 0:
        mask &= (i - j < window) if causal else ((i - j).abs() < window)
    return mask


@kiln_op(ATTENTION.op, mutates_args=(), schema=ATTENTION.schema())
@ATTENTION.implements
def attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    num_heads: int,
    num_kv_heads: int,
    causal: bool,
    window: int,
    scale: float,
) -> torch.Tensor:
    """Multi-head attention with GQA by head counts. q [B, T, H * D], k/v [B, S, Hkv * D] -> [B, T, H * D].

    window > 0 limits each query to the last `window` keys (itself included); queries are aligned to the end
    of the keys, so S >= T covers a cached prefix.
    """
    b, t, _ = q.shape
    s = k.shape[1]
    d = q.shape[2] // num_heads
    qh = q.view(b, t, num_heads, d).transpose(1, 2).float()
    kh = k.view(b, s, num_kv_heads, d).transpose(1, 2).float()
    vh = v.view(b, s, num_kv_heads, d).transpose(1, 2).float()
    group = num_heads // num_kv_heads
    kh = kh.repeat_interleave(group, dim=1)
    vh = vh.repeat_interleave(group, dim=1)
    scores = (qh @ kh.transpose(-1, -2)) * scale
    mask = attention_mask(t, s, causal, window, q.device)
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    out = torch.softmax(scores, dim=-1) @ vh
    return out.transpose(1, 2).reshape(b, t, num_heads * d).to(q.dtype)


@attention.register_fake
def _(q, *rest):
    return torch.empty_like(q)


@kiln_op("kiln::act", mutates_args=())
def act(x: torch.Tensor, kind: str) -> torch.Tensor:
    """Elementwise activation: kind in silu, gelu, gelu_tanh, relu."""
    return _act(x, kind)


@act.register_fake
def _(x, kind):
    return torch.empty_like(x)


@kiln_op("kiln::gated_act", mutates_args=())
def gated_act(gate: torch.Tensor, up: torch.Tensor, kind: str) -> torch.Tensor:
    """act(gate) * up: silu is SwiGLU, gelu / gelu_tanh are GeGLU."""
    return _act(gate, kind) * up


@gated_act.register_fake
def _(gate, up, kind):
    return torch.empty_like(up)


@kiln_op("kiln::add", mutates_args=())
def add(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Residual add (its own op so fusion passes can match norm(x + residual))."""
    return a + b


@add.register_fake
def _(a, b):
    return torch.empty_like(a)
