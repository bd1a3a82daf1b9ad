"""Hand-built ModelConfigs for tests (built directly, so these tests do not depend on the spec parser)."""

from __future__ import annotations

from kiln.model_config import (
    Add,
    AttentionCall,
    LayerAssign,
    MlpCall,
    ModelConfig,
    NormCall,
    NormConfig,
    RopeConfig,
    RopeScaling,
    Var,
)

X = Var("x")


def pre_norm_body(attn: AttentionCall, act: str = "swiglu", mlp_bias: bool = False) -> tuple[LayerAssign, ...]:
    """x = x + attention(norm(x)); x = x + mlp(norm(x)) with the attention site's options taken from `attn`."""
    attn_call = AttentionCall(
        NormCall(X, "norm0"), "attn0", attn.causal, attn.window, attn.qkv_bias, attn.out_bias, attn.rope
    )
    return (
        LayerAssign("x", Add(X, attn_call)),
        LayerAssign("x", Add(X, MlpCall(NormCall(X, "norm1"), "mlp0", act, mlp_bias))),
    )


def tiny_llama(layers: int = 2, tie: bool = False) -> ModelConfig:
    """Llama-style: RMS norm, rope with llama3 scaling, GQA 4:2, SwiGLU."""
    scaling = RopeScaling("llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0, original_context=32)
    return ModelConfig(
        name="tiny-llama",
        vocab=97,
        dim=64,
        layers=layers,
        heads=4,
        kv_heads=2,
        head_dim=16,
        ffn=96,
        context=64,
        norm=NormConfig("rms", 1e-5),
        body=pre_norm_body(AttentionCall(X, "attn0")),
        rope=RopeConfig(theta=10000.0, scaling=scaling),
        tie_embeddings=tie,
    )


def tiny_gpt2() -> ModelConfig:
    """GPT-2-style: layer norm, learned positions, biases everywhere, plain gelu_tanh MLP, tied embeddings."""
    attn = AttentionCall(X, "attn0", qkv_bias=True, out_bias=True, rope=False)
    return ModelConfig(
        name="tiny-gpt2",
        vocab=101,
        dim=48,
        layers=2,
        heads=4,
        kv_heads=4,
        head_dim=12,
        ffn=192,
        context=40,
        norm=NormConfig("layer", 1e-5),
        body=pre_norm_body(attn, act="gelu_tanh", mlp_bias=True),
        rope=None,
        positions="learned",
        tie_embeddings=True,
    )


def tiny_mistral() -> ModelConfig:
    """Sliding-window attention (window 5), MQA (kv_heads 1), GeGLU, no rope scaling."""
    return ModelConfig(
        name="tiny-mistral",
        vocab=64,
        dim=32,
        layers=3,
        heads=4,
        kv_heads=1,
        head_dim=8,
        ffn=64,
        context=48,
        norm=NormConfig("rms", 1e-6),
        body=pre_norm_body(AttentionCall(X, "attn0", window=5), act="geglu"),
        rope=RopeConfig(theta=500.0),
    )


def tiny_parallel() -> ModelConfig:
    """GPT-J-style parallel block: h = norm(x); x = x + attention(h) + mlp(h); no positions, no final norm."""
    h = Var("h")
    body = (
        LayerAssign("h", NormCall(X, "norm0")),
        LayerAssign("x", Add(Add(X, AttentionCall(h, "attn0", causal=True)), MlpCall(h, "mlp0", "relu"))),
    )
    return ModelConfig(
        name="tiny-parallel",
        vocab=50,
        dim=32,
        layers=2,
        heads=2,
        kv_heads=2,
        head_dim=16,
        ffn=64,
        context=32,
        norm=NormConfig("rms", 1e-5),
        body=body,
        rope=None,
        positions="none",
        final_norm=False,
    )


def llama31_8b() -> ModelConfig:
    """Llama-3.1-8B's real hyperparameters (for meta-device builds only)."""
    scaling = RopeScaling("llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0, original_context=8192)
    return ModelConfig(
        name="llama-3.1-8b",
        vocab=128256,
        dim=4096,
        layers=32,
        heads=32,
        kv_heads=8,
        head_dim=128,
        ffn=14336,
        context=131072,
        norm=NormConfig("rms", 1e-5),
        body=pre_norm_body(AttentionCall(X, "attn0")),
        rope=RopeConfig(theta=500000.0, scaling=scaling),
    )


TINY = {"llama": tiny_llama, "gpt2": tiny_gpt2, "mistral": tiny_mistral, "parallel": tiny_parallel}
