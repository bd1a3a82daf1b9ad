"""Quantization math (kiln.quant.formats), the quantized ops' references, the spec's `quantize` setting and
quantized checkpoints (kiln.compile.quantized)."""

from __future__ import annotations

import pytest
import torch

import kiln.ir.ops_quant  # noqa: F401  (registers the quantized ops)
from kiln.errors import KilnError, SpecError
from kiln.quant.formats import (
    QuantScheme,
    dequantize,
    pack_int4,
    parse_scheme,
    quantize_rtn,
    repack_int4_v1,
    unpack_int4,
)
from kiln.spec.loader import load_spec, parse_and_resolve

SCHEMES = [QuantScheme(bits=8)] + [QuantScheme(bits=4, group=g, symmetric=s) for g in (32, 64, 128) for s in (1, 0)]


def test_pack_unpack_round_trip():
    codes = torch.randint(0, 16, (5, 64), dtype=torch.uint8)
    packed = pack_int4(codes)
    assert packed.shape == (5, 32) and packed.dtype == torch.uint8
    assert torch.equal(unpack_int4(packed), codes)
    # GGML's block order: byte j of a 32-k block = k j (low nibble) | k j + 16 (high nibble)
    assert packed[0, 0] == codes[0, 0] | (codes[0, 16] << 4)
    assert packed[1, 16 + 3] == codes[1, 32 + 3] | (codes[1, 32 + 16 + 3] << 4)
    with pytest.raises(KilnError, match="multiple of 32"):
        pack_int4(codes[:, :48])


def test_layout_v1_repacks_to_the_same_codes():
    codes = torch.randint(0, 16, (3, 96), dtype=torch.uint8)
    v1 = codes[:, 0::2] | (codes[:, 1::2] << 4)  # version 1: neighbouring k paired in a byte
    assert torch.equal(unpack_int4(repack_int4_v1(v1)), codes)


@pytest.mark.parametrize("scheme", SCHEMES, ids=lambda s: s.label)
def test_rtn_error_is_within_half_a_step(scheme):
    torch.manual_seed(0)
    w = torch.randn(24, 256) * 0.05
    qw = quantize_rtn(w, scheme)
    n, k = w.shape
    assert qw.shape == (n, k)
    group = k if scheme.bits == 8 else scheme.group
    step = qw.scales.reshape(n, -1).repeat_interleave(group, dim=1)
    err = (dequantize(qw) - w).abs()
    assert (err <= step / 2 + 1e-7).all()
    want_dtype = torch.int8 if scheme.bits == 8 else torch.uint8
    assert qw.qweight.dtype == want_dtype and qw.scales.dtype == torch.float32
    assert (qw.zeros is None) == scheme.symmetric


def test_rtn_keeps_zero_rows_and_extremes_exact():
    w = torch.zeros(3, 64)
    w[1, 5] = 2.0
    w[2] = torch.linspace(-1, 3, 64)
    for scheme in SCHEMES[:2]:
        d = dequantize(quantize_rtn(w, scheme))
        assert torch.equal(d[0], torch.zeros(64))
        assert d[1, 5] == pytest.approx(2.0)
        assert d[2].abs().max() == pytest.approx(3.0)


def test_quantized_ops_are_dequantize_then_linear():
    torch.manual_seed(1)
    w, x, b = torch.randn(40, 96), torch.randn(2, 3, 96), torch.randn(40)
    for scheme in SCHEMES[:3]:
        qw = quantize_rtn(w, scheme)
        if scheme.bits == 8:
            got = torch.ops.kiln.linear_w8(x, qw.qweight, qw.scales, b)
        else:
            got = torch.ops.kiln.linear_w4(x, qw.qweight, qw.scales, qw.zeros, qw.group, b)
        torch.testing.assert_close(got, torch.nn.functional.linear(x, dequantize(qw), b))
        ids = torch.tensor([[0, 39, 7]])
        rows = torch.ops.kiln.embedding_q(qw.qweight, qw.scales, qw.zeros, ids, qw.bits, qw.group, torch.bfloat16)
        assert rows.dtype == torch.bfloat16
        torch.testing.assert_close(rows, dequantize(qw)[ids].bfloat16())


def test_k_not_a_multiple_of_the_group_is_an_error():
    with pytest.raises(KilnError, match=r"K = 96 is not a multiple of 64; pick a group that divides 96 \(32\)"):
        quantize_rtn(torch.randn(8, 96), QuantScheme(bits=4, group=64))
    with pytest.raises(KilnError, match=r"int4: its K = 40 is not a multiple of 32, .* no int4 group fits; use int8"):
        quantize_rtn(torch.randn(8, 40), QuantScheme(bits=4, group=128))


@pytest.mark.parametrize(
    "text,label",
    [("int8", "int8"), ("int4", "int4-rtn-g128"), ("int4-gptq-g32", "int4-gptq-g32"),
     ("int4-g64-asym", "int4-rtn-g64-asym"), ("int8-gptq", "int8-gptq")],
)  # fmt: skip
def test_parse_scheme(text, label):
    assert parse_scheme(text).label == label


@pytest.mark.parametrize("text", ["int3", "int4-g48", "int8-g32", "int4-awq", "int8-asym"])
def test_parse_scheme_rejects(text):
    with pytest.raises(KilnError):
        parse_scheme(text)


# ---- the spec's `quantize` setting --------------------------------------------------------------------------


def _spec(quantize: str) -> str:
    text = load_spec("tiny-llama").path
    src = open(text).read()
    return src.replace("dtype = fp32", f"dtype = fp32\n  quantize = {quantize}")


@pytest.mark.parametrize(
    "value,scheme",
    [
        ("int8", QuantScheme(bits=8)),
        ("int4", QuantScheme(bits=4, group=128, auto_group=True)),  # 128, or the largest group that fits
        ("int4(group = 32, method = gptq, symmetric = false, tokens = 64)",
         QuantScheme(bits=4, group=32, method="gptq", symmetric=False, tokens=64)),
        ("int8(lm_head = true, embeddings = true)", QuantScheme(bits=8, lm_head=True, embeddings=True)),
    ],
)  # fmt: skip
def test_spec_quantize_values(value, scheme):
    loaded = parse_and_resolve(_spec(value), "/specs/m.kiln")
    assert QuantScheme.from_dict(loaded.compile.extra["quantize"]) == scheme


def test_spec_calibration_path_is_relative_to_the_spec():
    loaded = parse_and_resolve(_spec('int4(method = gptq, calibration = "calib.txt")'), "/specs/m.kiln")
    assert loaded.compile.extra["quantize"]["calibration"] == "/specs/calib.txt"


@pytest.mark.parametrize(
    "value,message",
    [
        ("int3", "unknown quantize `int3`; did you mean `int8`?"),
        ("int4(group = 100)", "group must be one of 32, 64, 128, got 100"),
        ("int8(group = 32)", "unknown argument `group` to int8()"),
        ("int4(method = awq)", "unknown quantization method `awq`"),
        ("int4(calibration = 3)", "calibration must be a file name in quotes, got 3"),
        ('"int8"', "quantize must be a call like int4(group = 128, method = gptq)"),
        ("int4(tokens = 0)", "tokens must be a positive integer, got 0"),
        ("int4(lm_head = 1)", "lm_head must be true or false, got 1"),
        ("int4(symmetric = yes)", "symmetric must be true or false"),
        ("int4(128)", "int4() takes keyword arguments only"),
        ('int4(calibration = "c.txt")', "calibration is read only by GPTQ calibration, and this quantize uses "
                                        "round-to-nearest (method = rtn, the default)"),
        ("int8(method = rtn, tokens = 64)", "tokens is read only by GPTQ calibration"),
    ],
)
def test_spec_quantize_errors(value, message):
    with pytest.raises(SpecError) as info:
        parse_and_resolve(_spec(value), "m.kiln")
    assert message in str(info.value)
    assert "m.kiln:23:" in str(info.value)  # points at the quantize line


# ---- quantized checkpoints ------------------------------------------------------------------------------


@pytest.mark.parametrize("scheme", ["int8", "int4-g32-asym"])
def test_save_and_load_quantized_checkpoint(tmp_path, scheme):
    from kiln.compile.pipeline import quantize_graph
    from kiln.compile.quantized import is_quantized_checkpoint, load_quantized, save_quantized
    from kiln.ir.frontend import build_graph
    from kiln.ir.text import format_graph

    cfg = load_spec("tiny-llama").model
    gm = quantize_graph(build_graph(cfg, dtype=torch.bfloat16), parse_scheme(scheme, embeddings=True))
    save_quantized(gm, tmp_path, cfg)
    assert is_quantized_checkpoint(tmp_path)
    loaded = load_quantized(tmp_path)  # the model comes from the saved spec.kiln
    assert format_graph(loaded) == format_graph(gm)
    assert loaded.meta["kiln_quantize"] == gm.meta["kiln_quantize"]
    tokens = torch.randint(0, cfg.vocab, (2, 9))
    positions = torch.arange(9).expand(2, 9)
    assert torch.equal(loaded(tokens, positions), gm(tokens, positions))


def _rewrite_checkpoint(path, version: int, repack=None) -> None:
    """Set quantization.json's version and pass each int4 qweight through repack (a layout change)."""
    import json

    from safetensors.torch import load_file, save_file

    meta = json.loads((path / "quantization.json").read_text())
    meta["version"] = version
    (path / "quantization.json").write_text(json.dumps(meta))
    if repack is not None:
        tensors = load_file(str(path / "model.safetensors"))
        for e in meta["weights"].values():
            if e["bits"] == 4:
                tensors[e["qweight"]] = repack(tensors[e["qweight"]]).contiguous()
        save_file(tensors, str(path / "model.safetensors"))


def test_a_layout_v1_checkpoint_loads_repacked_and_an_unknown_version_is_refused(tmp_path):
    from kiln.compile.pipeline import quantize_graph
    from kiln.compile.quantized import load_quantized, save_quantized
    from kiln.errors import WeightError
    from kiln.ir.frontend import build_graph

    cfg = load_spec("tiny-llama").model
    gm = quantize_graph(build_graph(cfg), parse_scheme("int4-g32", embeddings=True))
    save_quantized(gm, tmp_path, cfg)

    def to_v1(packed):  # what kiln before layout 2 wrote for the same codes
        codes = unpack_int4(packed)
        return codes[:, 0::2] | (codes[:, 1::2] << 4)

    _rewrite_checkpoint(tmp_path, 1, to_v1)
    loaded = load_quantized(tmp_path)
    assert all(torch.equal(t, gm.state_dict()[k]) for k, t in loaded.state_dict().items())
    tokens, positions = torch.randint(0, cfg.vocab, (1, 7)), torch.arange(7)[None]
    assert torch.equal(loaded(tokens, positions), gm(tokens, positions))
    _rewrite_checkpoint(tmp_path, 99)
    with pytest.raises(WeightError, match="v99, expected kiln-quantized v1 or v2; quantize the model again"):
        load_quantized(tmp_path)


def test_loading_against_another_model_is_a_weight_error(tmp_path):
    import dataclasses

    from kiln.compile.pipeline import quantize_graph
    from kiln.compile.quantized import load_quantized, save_quantized
    from kiln.errors import WeightError
    from kiln.ir.frontend import build_graph

    cfg = load_spec("tiny-llama").model
    save_quantized(quantize_graph(build_graph(cfg), "int8"), tmp_path, cfg)
    with pytest.raises(WeightError, match="does not match model"):
        load_quantized(tmp_path, dataclasses.replace(cfg, ffn=192))
    with pytest.raises(WeightError, match="not a kiln quantized checkpoint"):
        load_quantized(tmp_path / "nowhere")
