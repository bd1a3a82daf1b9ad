"""Llama-3-style GGUFs: rope_freqs.weight (llama3 rope scaling as per-pair divisors) read back as kiln's
RopeScaling("llama3", ...), checked against the metadata, and the model's logits against transformers' Llama with
the same llama3 rope parameters and the file's own tensors (transformers' GGUF config does not read rope_freqs)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from kiln.errors import KilnError
from kiln.gguf.config import config_from_gguf, open_gguf
from kiln.model_config import RopeScaling
from tests.support.spm_files import hf_model, llama3_factors, write_spm_gguf

# original = 64 puts the tiny model's 8 rotary pairs in all three bands (kept, smoothed, divided by the factor).
SCALING = {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 64}
META = {"llama.rope.scaling.factor": 8.0, "llama.rope.scaling.original_context_length": 64}


def _freqs(**over) -> np.ndarray:
    p = {**SCALING, **over}
    return llama3_factors(10000.0, 16, p["factor"], p["low_freq_factor"], p["high_freq_factor"],
                          p["original_max_position_embeddings"])


@pytest.fixture(scope="module")
def llama3(tmp_path_factory):
    path = tmp_path_factory.mktemp("rope") / "tiny-llama3.gguf"
    write_spm_gguf(path, metadata=META, extra={"rope_freqs.weight": _freqs()})
    return path


def test_rope_freqs_become_llama3_scaling(llama3):
    cfg = config_from_gguf(open_gguf(llama3), llama3)
    assert cfg.rope.scaling == RopeScaling("llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                                           original_context=64)
    divisors = _freqs()
    assert (divisors == 1).any() and (divisors == 8).any() and ((divisors > 1) & (divisors < 8)).any()


def test_logits_equal_transformers_with_llama3_rope(llama3):
    from kiln.build import load_model

    m = load_model(None, llama3, device="cpu", quantize="none", dtype="fp32")
    ids = [1] + [(7 * i + 3) % 380 + 3 for i in range(39)]
    with torch.no_grad():
        got = m.gm(torch.tensor([ids]), torch.arange(len(ids))[None])[0]
        want = hf_model(llama3, {"rope_type": "llama3", "rope_theta": 10000.0, **SCALING})(
            torch.tensor([ids])).logits[0]
        plain = hf_model(llama3)(torch.tensor([ids])).logits[0]
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    assert (got - plain).abs().max() > 1e-2  # the scaling matters at these positions: the check can fail


def _refused(path, capsys, *needles):
    from kiln.cli import main

    assert main(["run", "--weights", str(path), "--prompt", "x"]) == 2
    err = capsys.readouterr().err
    assert err.count("kiln: error:") == 1 and str(path) in err
    for needle in needles:
        assert needle in err, err


def test_a_tensor_that_is_not_the_metadata_s_scaling_is_refused(tmp_path, capsys):
    bad = _freqs()
    bad[2] *= 1.5
    path = tmp_path / "edited.gguf"
    write_spm_gguf(path, metadata=META, extra={"rope_freqs.weight": bad})
    _refused(path, capsys, "rope_freqs.weight is not the llama3 rope scaling", "rope_freqs[2] is",
             "llama3(factor = 8, low = 1, high = 4, original = 64)")
    path = tmp_path / "factor.gguf"
    write_spm_gguf(path, metadata={**META, "llama.rope.scaling.factor": 4.0}, extra={"rope_freqs.weight": _freqs()})
    _refused(path, capsys, "factor = 4", "where the parameters give 4")


def test_without_metadata_the_converter_s_defaults_are_checked(tmp_path, capsys):
    """No rope.scaling keys (what convert_hf_to_gguf.py writes for Llama 3.x): factor = the largest divisor, low 1,
    high 4, original 8192; a tensor made with another original context does not pass as them."""
    path = tmp_path / "defaults.gguf"
    write_spm_gguf(path, extra={"rope_freqs.weight": _freqs(original_max_position_embeddings=8192, factor=32.0)})
    assert config_from_gguf(open_gguf(path), path).rope.scaling == RopeScaling("llama3", factor=32.0)
    path = tmp_path / "other.gguf"
    write_spm_gguf(path, extra={"rope_freqs.weight": _freqs()})  # original 64, not in the file: 8192 is checked
    _refused(path, capsys, "original = 8192", "re-convert")


def test_rope_freqs_with_another_scaling_type_is_refused(tmp_path, capsys):
    path = tmp_path / "both.gguf"
    write_spm_gguf(path, metadata={**META, "llama.rope.scaling.type": "linear"}, extra={"rope_freqs.weight": _freqs()})
    _refused(path, capsys, "both rope_freqs.weight", "'linear'")


def test_a_spec_must_carry_the_file_s_scaling(llama3, tmp_path):
    """`kiln import` writes the scaling into the spec, which then loads; a spec without it is refused, so the
    tensor is never dropped."""
    from kiln.build import load_model
    from kiln.cli import main
    from kiln.spec.loader import load_spec

    spec = tmp_path / "llama3.kiln"
    assert main(["import", str(llama3), "-o", str(spec)]) == 0
    assert "llama3(" in spec.read_text()
    assert load_model(spec, llama3, device="cpu", quantize="none").model == load_spec(spec).model
    plain = tmp_path / "plain.kiln"
    plain.write_text(spec.read_text().replace(spec.read_text().split("rope = ")[1].split("\n")[0],
                                              "rope(theta = 10000)"))
    # refused when the spec is compared with the file's metadata, before the rope_freqs tensor is read
    with pytest.raises(KilnError, match="rope scaling: none in the spec, llama3 in the checkpoint"):
        load_model(plain, llama3, device="cpu", quantize="none")
