"""A GPTQ scheme's calibration file (a spec's `quantize = int4(method = gptq, calibration = "...")`) is encoded by the
model's own tokenizer wherever the model compiles (LLM, `kiln run`), as `kiln quantize --calibration` encodes it, and
both give the same quantized weights; a model without a tokenizer calibrates on the file's bytes, its own tokens."""

from __future__ import annotations

import pytest
import torch

from kiln.cli.commands import main
from tests.support.bpe_checkpoint import BPE_VOCAB, CALIBRATION_TEXT, save_bpe_checkpoint, write_spec

GPTQ = 'quantize = int4(group = 32, method = gptq, calibration = "calib.txt")'


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return save_bpe_checkpoint(tmp_path_factory.mktemp("bpe") / "llama")


@pytest.fixture
def spec(ckpt, tmp_path):
    (tmp_path / "calib.txt").write_text(CALIBRATION_TEXT)
    return write_spec(ckpt, tmp_path / "gptq.kiln", GPTQ)  # the file is found beside the spec


def _calibration_ids(monkeypatch) -> list[torch.Tensor]:
    """Every calibration id tensor the quantize pass builds from here on."""
    import kiln.passes.quantize as pq

    seen, real = [], pq.make_ids

    def spy(scheme, vocab, tokenizer=None):
        seen.append(real(scheme, vocab, tokenizer))
        return seen[-1]

    monkeypatch.setattr(pq, "make_ids", spy)
    return seen


def _model_tokens(ckpt) -> list[int]:
    from kiln.tokenizer import load_tokenizer

    ids = load_tokenizer(ckpt, vocab=BPE_VOCAB).encode(CALIBRATION_TEXT)
    assert max(ids) > 258 and len(ids) < len(CALIBRATION_TEXT.encode())  # merged tokens, not bytes
    assert len(ids) < 128  # one calibration row: the ids are the whole encoding
    return ids


def test_llm_calibrates_on_the_models_tokens(ckpt, spec, monkeypatch):
    from kiln import LLM

    seen = _calibration_ids(monkeypatch)
    LLM(str(spec), weights=str(ckpt))
    assert [ids.flatten().tolist() for ids in seen] == [_model_tokens(ckpt)]


def test_kiln_run_calibrates_on_the_models_tokens(ckpt, spec, monkeypatch, capsys):
    seen = _calibration_ids(monkeypatch)
    rc = main(["run", str(spec), "--weights", str(ckpt), "--prompt", "hello", "--max-tokens", "1", "--device", "cpu"])
    assert rc == 0, capsys.readouterr().err
    assert [ids.flatten().tolist() for ids in seen] == [_model_tokens(ckpt)]


def _quantized_tensors(gm: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {k: v for k, v in gm.state_dict().items() if k.endswith((".qweight", ".scales", ".zeros"))}


def test_llm_and_kiln_quantize_give_the_same_weights(ckpt, spec, tmp_path, capsys):
    """The spec's scheme in LLM, `kiln quantize --calibration` of the same file, and `kiln quantize SPEC` (the spec's
    scheme alone): the same calibration tokens, the same passes before quantize, so the same weights."""
    from kiln import LLM
    from kiln.compile.quantized import load_quantized

    served = _quantized_tensors(LLM(str(spec), weights=str(ckpt)).step_model.gm)
    assert served and any(k.endswith(".qkv.qweight") for k in served)
    by_flag, by_spec = tmp_path / "by-flag", tmp_path / "by-spec"
    assert main(["quantize", "--weights", str(ckpt), "--quantize", "int4-gptq-g32", "--calibration",
                 str(tmp_path / "calib.txt"), "-o", str(by_flag), "--device", "cpu"]) == 0
    assert main(["quantize", str(spec), "--weights", str(ckpt), "-o", str(by_spec), "--device", "cpu"]) == 0
    capsys.readouterr()
    for out in (by_flag, by_spec):
        saved = _quantized_tensors(load_quantized(out))
        assert saved.keys() == served.keys()
        assert all(torch.equal(saved[k], served[k]) for k in saved), out.name


def test_without_a_tokenizer_the_files_bytes_are_the_models_tokens(ckpt, tmp_path, monkeypatch):
    from kiln import LLM
    from kiln.tokenizer import ByteTokenizer

    (tmp_path / "calib.txt").write_text(CALIBRATION_TEXT)
    random_weights = write_spec(ckpt, tmp_path / "random.kiln", GPTQ)
    seen = _calibration_ids(monkeypatch)
    llm = LLM(str(random_weights))  # no checkpoint: kiln's byte-level tokenizer encodes prompts, and calibration
    assert isinstance(llm.tokenizer, ByteTokenizer)
    want = list(CALIBRATION_TEXT.encode())
    assert llm.tokenizer.encode(CALIBRATION_TEXT) == want
    assert torch.equal(seen[0], torch.tensor(want[:128]).view(1, 128))
