"""GPTQ (kiln.quant.gptq): better layer outputs than round-to-nearest, calibration tokens, and its errors."""

from __future__ import annotations

import pytest
import torch

from kiln.errors import KilnError, PassError
from kiln.quant.formats import QuantScheme, dequantize, quantize_rtn
from kiln.quant.gptq import calibrate, calibration_ids, gptq_quantize, hessian

SCHEMES = [QuantScheme(bits=8), QuantScheme(bits=4, group=32), QuantScheme(bits=4, group=64, symmetric=False)]


def _inputs(n: int, k: int, seed: int) -> torch.Tensor:
    """Correlated inputs with a decaying spectrum, like real activations (white inputs leave GPTQ nothing)."""
    g = torch.Generator().manual_seed(0)
    mix = torch.randn(k, k, generator=g) * torch.logspace(0, -2, k)[:, None]
    return torch.randn(n, k, generator=torch.Generator().manual_seed(seed)) @ mix


@pytest.mark.parametrize("scheme", SCHEMES, ids=lambda s: s.label)
def test_gptq_output_error_beats_rtn_on_held_out_inputs(scheme):
    torch.manual_seed(0)
    w = torch.randn(48, 192) * 0.1
    calib, held_out = _inputs(1024, 192, 1), _inputs(512, 192, 2)
    qg = gptq_quantize(w, hessian(calib), scheme)
    qr = quantize_rtn(w, scheme)
    ref = held_out @ w.T
    err_g = (held_out @ dequantize(qg).T - ref).norm() / ref.norm()
    err_r = (held_out @ dequantize(qr).T - ref).norm() / ref.norm()
    assert err_g < 0.8 * err_r, (err_g, err_r)
    assert qg.qweight.dtype == qr.qweight.dtype and qg.qweight.shape == qr.qweight.shape
    assert qg.scales.shape == qr.scales.shape and (qg.zeros is None) == (qr.zeros is None)


def test_gptq_handles_dead_inputs_and_a_singular_hessian():
    w = torch.randn(16, 64)
    x = _inputs(8, 64, 3)  # fewer samples than features: X^T X is singular
    x[:, 5] = 0.0
    qw = gptq_quantize(w, hessian(x), QuantScheme(bits=4, group=32))
    assert torch.isfinite(dequantize(qw)).all()
    assert dequantize(qw)[:, 5].abs().max() == 0  # an input that is always zero gets a zero weight


def test_calibration_ids_random_and_from_text(tmp_path):
    scheme = QuantScheme(bits=4, group=32, method="gptq", tokens=100, seq_len=32)
    ids = calibration_ids(scheme, vocab=300)
    assert ids.shape == (3, 32) and int(ids.max()) < 300
    assert torch.equal(ids, calibration_ids(scheme, vocab=300))  # seeded
    text = tmp_path / "calib.txt"
    text.write_text("the quick brown fox jumps over the lazy dog " * 3)
    from_text = calibration_ids(QuantScheme(bits=8, method="gptq", calibration=str(text), seq_len=16), vocab=300)
    assert from_text.shape == (8, 16) and bytes(from_text[0, :9].tolist()) == b"the quick"
    with pytest.raises(KilnError, match="does not exist"):
        calibration_ids(QuantScheme(bits=8, method="gptq", calibration=str(tmp_path / "none.txt")), vocab=300)
    latin1 = tmp_path / "latin1.txt"
    latin1.write_bytes("caf\u00e9\r\n".encode("latin-1"))
    with pytest.raises(KilnError, match=r"latin1\.txt is not UTF-8 text \(byte 0xe9 at offset 3\); give a UTF-8"):
        calibration_ids(QuantScheme(bits=8, method="gptq", calibration=str(latin1)), vocab=300)
    crlf = tmp_path / "crlf.txt"
    crlf.write_bytes(b"a\r\nb\rc")  # newlines read as text mode reads them, as before
    assert calibration_ids(QuantScheme(bits=8, method="gptq", calibration=str(crlf)), vocab=300).tolist() == [
        list(b"a\nb\nc")]


def test_gptq_pass_calibrates_from_a_text_file(tmp_path):
    from kiln.compile.pipeline import quantize_graph
    from kiln.ir.frontend import build_graph
    from kiln.spec.loader import load_spec

    text = tmp_path / "calib.txt"
    text.write_text("Some calibration text, long enough to fill a couple of rows of tokens. " * 4)
    scheme = QuantScheme(bits=4, group=32, method="gptq", calibration=str(text), seq_len=64)
    gm = quantize_graph(build_graph(load_spec("tiny-llama").model), scheme)
    assert gm.graph.find_nodes(op="call_function", target=torch.ops.kiln.linear_w4.default)


def test_calibration_needs_the_whole_sequence_graph():
    from torch import fx

    g = fx.Graph()
    x = g.placeholder("slot_mapping")
    g.output(x)
    gm = fx.GraphModule(torch.nn.Module(), g)
    with pytest.raises(PassError, match="run quantize before kv_cache"):
        calibrate(gm, [], QuantScheme(bits=8, method="gptq"), torch.zeros(1, 4, dtype=torch.long))


def test_calibration_on_meta_names_both_the_spec_key_and_the_flag():
    from kiln.ir.frontend import build_graph
    from kiln.spec.loader import load_spec

    gm = build_graph(load_spec("tiny-llama").model, device="meta")
    with pytest.raises(PassError, match=r"`method = rtn` in a spec, --quantize int4-rtn on the command line"):
        calibrate(gm, [], QuantScheme(bits=4, group=32, method="gptq"), torch.zeros(1, 4, dtype=torch.long))
