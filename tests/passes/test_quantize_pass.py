"""The quantize pass (passes/quantize.py): rewrite, weights, selection, errors, pipeline wiring, kernels, bytes.

Quantized outputs cannot equal the unquantized graph, so check_pass runs on a graph whose weights are already
the dequantized ones (RTN of a dequantized weight gives the same codes back), and other schemes are checked
against the fused graph with each weight replaced by the dequantized form of what the pass stored.
"""

from __future__ import annotations

import copy

import pytest
import torch

import kiln.ir.ops_quant  # noqa: F401  (registers the quantized ops)
from kiln.cli.quality import weight_breakdown
from kiln.compile.pipeline import build_pipeline, quantize_graph, run_pipeline
from kiln.errors import PassError
from kiln.ir.frontend import build_graph
from kiln.ir.text import weight_bytes
from kiln.model_config import CompileConfig
from kiln.passes import gqa_fusion
from kiln.passes._graph import attr_tensor, set_param
from kiln.passes.quantize import make_pass
from kiln.quant.formats import QuantScheme, dequantize, dequantize_parts, parse_scheme, quantize_rtn
from kiln.spec.loader import load_spec
from tests.support.pass_helper import check_pass

kiln_ops = torch.ops.kiln
LINEAR, W8, W4 = kiln_ops.linear.default, kiln_ops.linear_w8.default, kiln_ops.linear_w4.default


def inputs(vocab: int, batch: int = 2, seq: int = 7):
    g = torch.Generator().manual_seed(5)
    return torch.randint(0, vocab, (batch, seq), generator=g), torch.arange(seq).expand(batch, seq).contiguous()


def fused(spec: str = "tiny-llama"):
    gm = build_graph(load_spec(spec).model)
    gqa_fusion.PASS.run(gm)
    gm.recompile()
    return gm


def linears(gm) -> list:
    return [n for n in gm.graph.nodes if n.op == "call_function" and n.target == LINEAR]


def fake_quantized(scheme: QuantScheme, spec: str = "tiny-llama"):
    """The fused graph with every non-lm_head weight replaced by its RTN dequantized form."""
    gm = fused(spec)
    for n in linears(gm)[:-1]:
        w = attr_tensor(gm, n.args[1])
        set_param(gm, str(n.args[1].target), dequantize(quantize_rtn(w, scheme), w.dtype))
    return gm


@pytest.mark.parametrize("scheme", [QuantScheme(bits=8), QuantScheme(bits=4, group=32)], ids=lambda s: s.label)
@pytest.mark.parametrize("spec", ["tiny-llama", "tiny-gpt2", "tiny-qwen3"])
def test_check_pass_on_dequantized_weights(scheme, spec):
    n = len(linears(fused(spec))) - 1  # every linear but the lm_head
    op = W8 if scheme.bits == 8 else W4
    cfg = load_spec(spec).model
    gm = check_pass(make_pass(scheme), lambda: fake_quantized(scheme, spec), inputs(cfg.vocab), {LINEAR: -n, op: n})
    assert not any(name.endswith("weight") and "norm" not in name and name not in ("embed.weight", "lm_head.weight")
                   and "pos_embed" not in name and "ln" not in name for name, _ in gm.named_parameters())


def _dequantized_reference(passed, spec: str):
    """The fused graph with each quantized weight replaced by the dequantized form the pass stored."""
    ref = fused(spec)
    buffers = dict(passed.named_buffers())
    for name, q in buffers.items():
        if name.endswith(".qweight"):
            prefix = name.removesuffix(".qweight")
            s, z = buffers[f"{prefix}.scales"], buffers.get(f"{prefix}.zeros")
            bits, group = (8, 0) if q.dtype == torch.int8 else (4, q.shape[1] * 2 // s.shape[1])
            set_param(ref, f"{prefix}.weight", dequantize_parts(q, s, z, bits, group))
    return ref


@pytest.mark.parametrize("text", ["int4-g32-asym", "int4-g64", "int4-gptq-g32", "int8-gptq"])
def test_output_equals_dequantized_reference(text):
    scheme = parse_scheme(text, tokens=64, seq_len=16)
    gm = quantize_graph(fused(), scheme)
    ref = _dequantized_reference(gm, "tiny-llama")
    x = inputs(512)
    torch.testing.assert_close(gm(*x), ref(*x), rtol=1e-5, atol=1e-5)
    assert gm.meta["kiln_quantize"] == scheme.to_dict()


def test_k_not_a_multiple_of_the_group_names_weight_k_and_group():
    with pytest.raises(PassError, match=r"layers\.0\.attn0\.qkv\.weight.*K = 64 is not a multiple of 128"):
        quantize_graph(build_graph(load_spec("tiny-llama").model), "int4-g128")


def test_lm_head_and_embeddings_are_opt_in_and_a_tied_table_is_quantized_once():
    cfg = load_spec("tiny-qwen2").model
    assert cfg.tie_embeddings
    plain = quantize_graph(build_graph(cfg), "int8")
    assert plain.graph.find_nodes(op="call_function", target=LINEAR)  # the lm_head stays
    assert hasattr(plain.get_submodule("embed"), "weight")
    both = quantize_graph(build_graph(cfg), parse_scheme("int8", lm_head=True, embeddings=True))
    assert not both.graph.find_nodes(op="call_function", target=LINEAR)
    assert len(both.graph.find_nodes(op="call_function", target=kiln_ops.embedding_q.default)) == 1
    names = {n for n, _ in both.named_buffers()} | {n for n, _ in both.named_parameters()}
    assert "embed.weight" not in names and "embed.qweight" in names and "lm_head.qweight" not in names
    x = inputs(cfg.vocab)
    ref = build_graph(cfg)
    rel = (both(*x) - ref(*x)).norm() / ref(*x).norm()
    assert rel < 0.05


def test_pipeline_adds_quantize_after_gqa_fusion_when_the_spec_asks():
    cc = CompileConfig(extra={"quantize": {"bits": 4, "group": 32}})
    names = [p.name for p in build_pipeline(cc)]
    assert names[:2] == ["gqa_fusion", "quantize"]
    assert "quantize" not in [p.name for p in build_pipeline(CompileConfig())]
    with pytest.raises(PassError, match="requires pass 'gqa_fusion'"):
        build_pipeline(CompileConfig(extra={"quantize": {"bits": 8}, "disable_passes": ["gqa_fusion"]}))
    gm = run_pipeline(build_graph(load_spec("tiny-llama").model), build_pipeline(cc), debug=True)
    assert not gm.graph.find_nodes(op="call_function", target=LINEAR)[:-1]


@pytest.mark.parametrize("seq", [1, 6])  # decode (GEMV) and prefill (GEMM)
def test_compiled_kernels_match_the_reference_path(seq, monkeypatch):
    import kiln.codegen.quant as quant
    from kiln.compile.driver import compile_model

    cfg = load_spec("tiny-llama").model
    cc = CompileConfig(extra={"quantize": {"bits": 4, "group": 32, "symmetric": False}})
    ref = compile_model(build_graph(cfg), cc, use_kernels=False)
    got = compile_model(build_graph(cfg), cc, use_kernels=True)
    launched, real = set(), quant.launch
    monkeypatch.setattr(quant, "launch", lambda template, *a: (launched.add(template), real(template, *a)))
    x = inputs(cfg.vocab, batch=1, seq=seq)
    torch.testing.assert_close(got(*x), ref(*x), rtol=1e-4, atol=1e-4)
    assert launched == {"quant_gemv" if seq <= quant.GEMV_MAX_M else "quant_gemm"}


def _linear_bytes(gm) -> int:
    skip = ("embed.", "lm_head.", "norm", "rope_inv_freq")
    tensors = dict(gm.named_parameters()) | dict(gm.named_buffers())
    return sum(t.numel() * t.element_size() for n, t in tensors.items() if not n.startswith(skip) and "norm" not in n)


def _meta_quantized(base, scheme):
    gm = copy.deepcopy(base)
    gqa_fusion.PASS.run(gm)
    assert make_pass(scheme).run(gm).modified  # bytes only: no recompile or shape propagation needed
    return gm


def test_weight_bytes_int8_half_int4_quarter_plus_scales():
    cfg = load_spec("llama-3.2-1b").model  # real sizes, built on the meta device (nothing allocated)
    base = build_graph(cfg, dtype=torch.bfloat16, device="meta")
    ratios = {}
    for text in ("int8", "int4-g128", "int4-g128-asym"):
        gm = _meta_quantized(base, parse_scheme(text))
        ratios[text] = _linear_bytes(gm) / _linear_bytes(base)
        assert weight_bytes(gm) < weight_bytes(base)
    assert 0.5 <= ratios["int8"] < 0.502  # + one fp32 scale per output row
    assert ratios["int4-g128"] == pytest.approx(0.25 + 4 / 128 / 2)  # + an fp32 scale per 128 weights
    assert ratios["int4-g128-asym"] == pytest.approx(0.25 + 5 / 128 / 2)  # + a uint8 zero per group
    whole = _meta_quantized(base, parse_scheme("int8", lm_head=True, embeddings=True))
    assert 0.5 <= weight_bytes(whole) / weight_bytes(base) < 0.503
    parts = weight_breakdown(whole)
    assert parts["total"] == weight_bytes(whole) == parts["quantized"] + parts["scales_zeros"] + parts["dense"]
    assert parts["quantized"] == weight_bytes(base) // 2 - parts["dense"] // 2  # norms stay bf16
