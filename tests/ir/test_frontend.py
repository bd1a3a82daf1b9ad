"""The frontend: graph structure, fake propagation, weights, rope frequencies."""

from __future__ import annotations

from collections import Counter

import pytest
import torch

from kiln.errors import WeightError
from kiln.ir.frontend import build_graph, check_weights, propagate_fake, random_weights, rope_inv_freq
from kiln.model_config import ModelConfig, RopeConfig, RopeScaling, param_shapes
from tests.support.model_configs import TINY, llama31_8b, tiny_gpt2, tiny_llama, tiny_parallel

ops = torch.ops.kiln


def _calls(gm: torch.fx.GraphModule) -> Counter:
    return Counter(n.target for n in gm.graph.nodes if n.op == "call_function")


@pytest.mark.parametrize("name", sorted(TINY))
def test_graph_lints_and_every_node_has_fake_val(name):
    cfg = TINY[name]()
    gm = build_graph(cfg)
    gm.graph.lint()
    for node in gm.graph.nodes:
        assert "val" in node.meta, node.name
    assert tuple(gm.graph.output_node().meta["val"].shape) == (1, 8, cfg.vocab)
    propagate_fake(gm, batch=3, seq=5)
    attn_width = cfg.heads * cfg.head_dim
    for node in gm.graph.nodes:
        val = node.meta["val"]
        if node.op == "placeholder":
            assert (tuple(val.shape), val.dtype) == ((3, 5), torch.long)
        elif node.target == ops.attention.default:
            assert tuple(val.shape) == (3, 5, attn_width)
        elif node.target in (ops.rms_norm.default, ops.layer_norm.default, ops.add.default):
            assert tuple(val.shape) == (3, 5, cfg.dim)
        elif node.op == "get_attr":
            assert (
                tuple(val.shape) == tuple(gm.get_parameter(node.target).shape)
                if node.target != "rope_inv_freq"
                else (cfg.head_dim // 2,)
            )
    assert tuple(gm.graph.output_node().meta["val"].shape) == (3, 5, cfg.vocab)


def test_fake_vals_match_real_outputs():
    gm = build_graph(tiny_llama(), dtype=torch.bfloat16)
    tokens = torch.tensor([[1, 5, 9, 2, 4, 8, 0, 3]])
    logits = gm(tokens, torch.arange(8)[None])
    val = gm.graph.output_node().meta["val"]
    assert (val.shape, val.dtype) == (logits.shape, logits.dtype) == (torch.Size([1, 8, 97]), torch.bfloat16)


def test_node_counts_per_layer():
    cfg = tiny_llama(layers=3)
    calls = _calls(build_graph(cfg))
    # per layer: 2 norms, q/k/v/o + gate/up/down linears, rope on q and k, 1 attention, 1 SwiGLU, 2 residual adds
    assert calls[ops.rms_norm.default] == 2 * 3 + 1  # + final norm
    assert calls[ops.linear.default] == 7 * 3 + 1  # + lm_head
    assert calls[ops.rope.default] == 2 * 3
    assert calls[ops.attention.default] == 3
    assert calls[ops.gated_act.default] == 3
    assert calls[ops.add.default] == 2 * 3
    assert calls[ops.embedding.default] == 1
    assert sum(calls.values()) == 15 * 3 + 3


def test_gpt2_style_graph_uses_layer_norm_learned_positions_and_biases():
    cfg = tiny_gpt2()
    gm = build_graph(cfg)
    calls = _calls(gm)
    assert calls[ops.embedding.default] == 2 and calls[ops.rope.default] == 0
    assert calls[ops.layer_norm.default] == 2 * 2 + 1 and calls[ops.act.default] == 2
    assert calls[ops.add.default] == 2 * 2 + 1  # + token/position embedding add
    q = next(n for n in gm.graph.nodes if n.name == "layers_0_attn0_q")
    assert q.args[2].target == "layers.0.attn0.q.bias"
    assert "rope_inv_freq" not in dict(gm.named_buffers())


def test_parallel_block_reads_named_variable():
    gm = build_graph(tiny_parallel())
    norm = next(n for n in gm.graph.nodes if n.name == "layers_0_norm0")
    users = {u.name for u in norm.users}
    assert users == {"layers_0_attn0_q", "layers_0_attn0_k", "layers_0_attn0_v", "layers_0_mlp0_up"}
    assert _calls(gm)[ops.rms_norm.default] == 2  # one per layer, no final norm


@pytest.mark.parametrize("name", sorted(TINY))
def test_params_named_per_param_shapes(name):
    cfg = TINY[name]()
    gm = build_graph(cfg)
    shapes = param_shapes(cfg)
    params = dict(gm.named_parameters())
    assert list(params) == list(shapes)
    assert all(tuple(p.shape) == shapes[n] and not p.requires_grad for n, p in params.items())
    assert list(gm.state_dict()) == list(shapes)  # rope_inv_freq is a non-persistent buffer


def test_tied_embeddings_share_one_tensor_and_node():
    cfg = tiny_llama(tie=True)
    gm = build_graph(cfg)
    assert "lm_head.weight" not in dict(gm.named_parameters())
    embed_nodes = [n for n in gm.graph.nodes if n.op == "get_attr" and n.target == "embed.weight"]
    assert len(embed_nodes) == 1
    assert {u.name for u in embed_nodes[0].users} == {"embed", "logits"}
    gm.get_parameter("embed.weight").data[3].zero_()  # a change to the one tensor shows in the logits
    logits = gm(torch.tensor([[1, 2]]), torch.tensor([[0, 1]]))
    assert torch.all(logits[..., 3] == 0)


def test_node_names_are_readable():
    names = {n.name for n in build_graph(tiny_llama()).graph.nodes}
    expected = {
        "tokens",
        "positions",
        "embed",
        "layers_0_norm0",
        "layers_0_attn0_q",
        "layers_0_attn0_q_rope",
        "layers_0_attn0",
        "layers_1_attn0_o",
        "layers_1_mlp0_gate",
        "layers_1_mlp0_act",
        "layers_1_mlp0_down",
        "final_norm",
        "logits",
    }
    assert expected <= names


def test_llama_8b_builds_on_meta_without_memory():
    cfg = llama31_8b()
    gm = build_graph(cfg, dtype=torch.bfloat16, device="meta")
    params = list(gm.parameters())
    assert all(p.device.type == "meta" and p.dtype == torch.bfloat16 for p in params)
    assert sum(p.numel() for p in params) == 8_030_261_248  # Llama-3.1-8B's published parameter count
    out = gm.graph.output_node().meta["val"]
    assert tuple(out.shape) == (1, 8, 128256) and out.dtype == torch.bfloat16
    assert gm.get_buffer("rope_inv_freq").dtype == torch.float32


def test_dtype_casts_weights_but_not_inv_freq():
    gm = build_graph(tiny_llama(), dtype=torch.float16)
    assert {p.dtype for p in gm.parameters()} == {torch.float16}
    assert gm.get_buffer("rope_inv_freq").dtype == torch.float32


def test_random_weights_seeded_and_initialised():
    cfg = tiny_gpt2()
    a, b, c = random_weights(cfg, seed=1), random_weights(cfg, seed=1), random_weights(cfg, seed=2)
    assert all(torch.equal(a[n], b[n]) for n in a)
    assert not torch.equal(a["embed.weight"], c["embed.weight"])
    assert torch.all(a["layers.0.norm0.weight"] == 1) and torch.all(a["layers.0.attn0.q.bias"] == 0)
    std = a["layers.0.mlp0.down.weight"].std().item()
    assert abs(std - cfg.ffn**-0.5) < 0.1 * cfg.ffn**-0.5


def test_given_weights_are_used():
    cfg = tiny_llama()
    weights = random_weights(cfg, seed=5)
    gm = build_graph(cfg, weights)
    assert torch.equal(gm.get_parameter("layers.1.mlp0.up.weight"), weights["layers.1.mlp0.up.weight"])
    tokens, pos = torch.tensor([[4, 7, 1]]), torch.tensor([[0, 1, 2]])
    torch.testing.assert_close(gm(tokens, pos), build_graph(cfg, seed=5)(tokens, pos))


def test_check_weights_names_every_problem():
    cfg = tiny_llama()
    weights = random_weights(cfg)
    del weights["layers.1.attn0.k.weight"]
    weights["layers.0.mlp0.up.weight"] = torch.zeros(95, 64)
    weights["layers.0.extra.weight"] = torch.zeros(3)
    with pytest.raises(WeightError) as err:
        build_graph(cfg, weights)
    msg = str(err.value)
    assert "missing: layers.1.attn0.k.weight (expected shape [32, 64])" in msg
    assert "wrong shape: layers.0.mlp0.up.weight expected [96, 64], got [95, 64]" in msg
    assert "unexpected: layers.0.extra.weight" in msg
    assert "3 problem(s)" in msg and "hint:" in msg


def test_check_weights_accepts_exact_set():
    cfg = tiny_gpt2()
    check_weights(cfg, random_weights(cfg, device="meta"))  # no error


def _hf_inv_freq(rope_parameters: dict, head_dim: int) -> torch.Tensor:
    from transformers import LlamaConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    hf = LlamaConfig(
        hidden_size=4 * head_dim,
        num_attention_heads=4,
        head_dim=head_dim,
        max_position_embeddings=131072,
        rope_parameters=rope_parameters,
    )
    return ROPE_INIT_FUNCTIONS[rope_parameters["rope_type"]](hf, "cpu")[0]


@pytest.mark.parametrize("head_dim", [64, 128])
def test_rope_inv_freq_llama3_matches_transformers(head_dim):
    cfg = llama31_8b()
    sc = RopeScaling("llama3", factor=32.0, low_freq_factor=1.0, high_freq_factor=4.0, original_context=8192)
    cfg = ModelConfig(**{**cfg.__dict__, "head_dim": head_dim, "rope": RopeConfig(500000.0, sc)})
    want = _hf_inv_freq(
        {
            "rope_type": "llama3",
            "rope_theta": 500000.0,
            "factor": 32.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 8192,
        },
        head_dim,
    )
    got = rope_inv_freq(cfg)
    assert got.dtype == torch.float32 and got.shape == (head_dim // 2,)
    torch.testing.assert_close(got, want, rtol=1e-6, atol=0)
    base = rope_inv_freq(ModelConfig(**{**cfg.__dict__, "rope": RopeConfig(500000.0)}))
    assert got[0] == base[0] and torch.allclose(got[-1], base[-1] / 32)  # high freqs kept, low ones slowed


def test_rope_inv_freq_linear_and_default_match_transformers():
    cfg = tiny_llama()
    linear = ModelConfig(**{**cfg.__dict__, "rope": RopeConfig(10000.0, RopeScaling("linear", factor=4.0))})
    want = _hf_inv_freq({"rope_type": "linear", "rope_theta": 10000.0, "factor": 4.0}, cfg.head_dim)
    torch.testing.assert_close(rope_inv_freq(linear), want, rtol=1e-6, atol=0)
    plain = ModelConfig(**{**cfg.__dict__, "rope": RopeConfig(10000.0)})
    torch.testing.assert_close(rope_inv_freq(plain), want * 4.0, rtol=1e-6, atol=0)
