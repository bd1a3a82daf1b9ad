"""bench/decode.py's baseline: a gpt-fast-style decoder over a kiln model's own weights, for torch.compile.

One module, one static KV cache [layers, kv_heads, max_len, head_dim] per k and v, plain torch ops (no kiln
custom op, so inductor sees and fuses everything): a step writes its tokens' K/V at their positions and
attends over the whole cache with a position mask, so every decode step has the same shapes and
torch.compile(mode="reduce-overhead") replays it as one CUDA graph. The math is kiln's reference ops' (rms norm
in fp32 then cast, rotate-half rope with kiln's scaled inverse frequencies, SwiGLU), so on the same weights it
computes what kiln's Level-1 graph does (tests/test_bench_decode.py checks this). Llama-family specs only.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from kiln.errors import KilnError
from kiln.ir.frontend import rope_inv_freq
from kiln.model_config import AttentionCall, MlpCall, ModelConfig


def check_llama_family(cfg: ModelConfig) -> None:
    """Refuse a spec the baseline does not implement (it is a benchmark baseline, not a general model)."""
    ok = cfg.norm.kind == "rms" and cfg.final_norm and cfg.positions == "rope" and len(cfg.body) == 2
    if ok:
        attn, mlp = (a.value.right for a in cfg.body)
        ok = (isinstance(attn, AttentionCall) and attn.causal and attn.window is None and attn.rope
              and not attn.qkv_bias and not attn.out_bias and isinstance(mlp, MlpCall) and mlp.act == "swiglu"
              and not mlp.bias)  # fmt: skip
    if not ok:
        raise KilnError(f"bench/decode.py's compiled baseline implements llama-family specs only (rms norm, rope, "
                        f"causal attention without bias, SwiGLU); {cfg.name!r} is not one: use llama-3.2-1b, "
                        "llama-3.1-8b or tiny-llama")


def _buf(name: str) -> str:
    return "w_" + name.replace(".", "_")


def _rms(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    xf = x.float()
    return w * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


def _rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [T, H, D]; cos / sin [T, 1, D] in x's dtype (rotate-half form)."""
    half = x.shape[-1] // 2
    return x * cos + torch.cat((-x[..., half:], x[..., :half]), dim=-1) * sin


class StaticDecoder(torch.nn.Module):
    def __init__(self, cfg: ModelConfig, params: dict[str, torch.Tensor], max_len: int):
        super().__init__()
        check_llama_family(cfg)
        self.cfg = cfg
        # Buffers (shared with kiln, not copied), so torch.compile treats weights and caches as static addresses
        # and a CUDA-graph replay does not copy them in. Named after kiln's parameters, dots as underscores.
        self.names = list(params)
        for name, t in params.items():
            self.register_buffer(_buf(name), t, persistent=False)
        self.tied = "lm_head.weight" not in params  # tied embeddings have no lm_head
        emb = params["embed.weight"]
        self.dtype, self.device, self.max_len = emb.dtype, emb.device, max_len
        shape = (cfg.layers, cfg.kv_heads, max_len, cfg.head_dim)
        self.register_buffer("k_cache", torch.zeros(shape, dtype=self.dtype, device=self.device), persistent=False)
        self.register_buffer("v_cache", torch.zeros(shape, dtype=self.dtype, device=self.device), persistent=False)
        freqs = torch.arange(max_len, dtype=torch.float32)[:, None] * rope_inv_freq(cfg)[None, :]
        emb2 = torch.cat((freqs, freqs), dim=-1).to(self.device)
        # fp32 [max_len, D], indexed by position each step
        self.register_buffer("cos", emb2.cos(), persistent=False)
        self.register_buffer("sin", emb2.sin(), persistent=False)

    def w(self, name: str) -> torch.Tensor:
        return getattr(self, _buf(name))

    def forward(self, tokens: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        """tokens, pos int64 [T] (consecutive positions of one sequence) -> fp32 logits [T, vocab]."""
        cfg, p, eps = self.cfg, self.w, self.cfg.norm.eps
        h, hkv, d = cfg.heads, cfg.kv_heads, cfg.head_dim
        t = tokens.shape[0]
        x = F.embedding(tokens, p("embed.weight"))
        cos = self.cos[pos][:, None, :].to(self.dtype)
        sin = self.sin[pos][:, None, :].to(self.dtype)
        # Query t sees cache positions <= pos[t]; slots past the sequence are masked out (they hold zeros).
        mask = torch.arange(self.max_len, device=pos.device)[None, :] <= pos[:, None]
        for i in range(cfg.layers):
            pre = f"layers.{i}."
            a = _rms(x, p(pre + "norm0.weight"), eps)
            q = _rope(F.linear(a, p(pre + "attn0.q.weight")).view(t, h, d), cos, sin)
            k = _rope(F.linear(a, p(pre + "attn0.k.weight")).view(t, hkv, d), cos, sin)
            v = F.linear(a, p(pre + "attn0.v.weight")).view(t, hkv, d)
            self.k_cache[i].index_copy_(1, pos, k.transpose(0, 1))
            self.v_cache[i].index_copy_(1, pos, v.transpose(0, 1))
            o = F.scaled_dot_product_attention(q.transpose(0, 1), self.k_cache[i], self.v_cache[i], attn_mask=mask,
                                               enable_gqa=h != hkv)  # fmt: skip
            x = x + F.linear(o.transpose(0, 1).reshape(t, h * d), p(pre + "attn0.o.weight"))
            m = _rms(x, p(pre + "norm1.weight"), eps)
            gate = F.silu(F.linear(m, p(pre + "mlp0.gate.weight"))) * F.linear(m, p(pre + "mlp0.up.weight"))
            x = x + F.linear(gate, p(pre + "mlp0.down.weight"))
        head = p("embed.weight") if self.tied else p("lm_head.weight")
        return F.linear(_rms(x, p("final_norm.weight"), eps), head).float()

    def bytes_per_step(self, context: int) -> int:
        """Bytes a one-token step must read: every weight but the embedding table (one row), plus the K/V of
        `context` positions (what a paged decode reads; this baseline reads its whole static cache)."""
        size = {n: self.w(n).numel() * self.w(n).element_size() for n in self.names}
        weights = sum(size.values()) - (0 if self.tied else size["embed.weight"])
        kv = 2 * self.cfg.layers * self.cfg.kv_heads * self.cfg.head_dim * context * self.k_cache.element_size()
        return weights + kv
