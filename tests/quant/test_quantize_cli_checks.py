"""`kiln quantize`: the tokenizer and chat template travel with the weights (from a GGUF or a checkpoint dir), and
the command refuses what would give a wrong or destructive result (a quantized source, the source or a foreign
directory as output, a file that is not UTF-8) before any work."""

from __future__ import annotations

import json
import shutil

import pytest

from kiln.cli.commands import main
from kiln.tokenizer import load_tokenizer
from tests.support.gguf_helper import write_tiny_gguf
from tests.support.hf_models import save_hf_model

TEXT = "the other one in the north"
CHAT = [{"role": "user", "content": "hi there"}]


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("hf") / "llama"
    save_hf_model("llama", d)
    return d


def _quantize(capsys, *argv) -> tuple[int, str]:
    try:
        rc = main(["quantize", *argv])
    except SystemExit as e:
        rc = e.code
    return rc, capsys.readouterr().err


def test_a_gguf_tokenizer_and_chat_template_travel_with_the_weights(tmp_path, capsys):
    from kiln.build import load_model
    from kiln.gguf.config import open_gguf
    from kiln.gguf.tokenizer import load_gguf_tokenizer

    src = tmp_path / "tiny.Q4_1.gguf"
    write_tiny_gguf(src)
    out = tmp_path / "q"
    assert _quantize(capsys, "--weights", str(src), "--quantize", "int8", "-o", str(out), "--device", "cpu")[0] == 0
    want = load_gguf_tokenizer(open_gguf(src), src)
    got = load_model(None, out, device="cpu").tokenizer
    assert type(got).__name__ == "HFTokenizer"  # not the byte fallback
    assert got.encode(TEXT) == want.encode(TEXT)
    assert got.decode(want.encode(TEXT)) == want.decode(want.encode(TEXT))
    assert got.eos_token_ids == want.eos_token_ids
    assert got.apply_chat_template(CHAT) == want.apply_chat_template(CHAT)


def test_a_gguf_that_adds_bos_still_adds_it_after_quantize(tmp_path):
    from kiln.gguf.config import open_gguf
    from kiln.gguf.tokenizer import load_gguf_tokenizer
    from tests.support.spm_files import write_spm_gguf

    src = tmp_path / "spm.gguf"
    write_spm_gguf(src, add_bos=True)
    want = load_gguf_tokenizer(open_gguf(src), src)
    want.save_checkpoint_files(tmp_path)
    got = load_tokenizer(tmp_path, vocab=want.vocab_size)
    ids = want.encode("hello world")
    assert ids[0] == want.bos_id and got.encode("hello world") == ids
    assert got.decode(ids) == want.decode(ids)


def test_a_checkpoint_dirs_chat_template_jinja_travels_too(hf_dir, tmp_path, capsys):
    src = tmp_path / "src"
    shutil.copytree(hf_dir, src)
    (src / "chat_template.jinja").write_text("{% for m in messages %}MINE {{ m['content'] }}{% endfor %}")
    (src / "special_tokens_map.json").write_text("{}")
    out = tmp_path / "q"
    assert _quantize(capsys, "--weights", str(src), "--quantize", "int8", "-o", str(out), "--device", "cpu")[0] == 0
    assert (out / "chat_template.jinja").read_text() == (src / "chat_template.jinja").read_text()
    assert (out / "special_tokens_map.json").is_file()


def test_a_quantized_checkpoint_is_not_quantized_again(hf_dir, tmp_path, capsys):
    q = tmp_path / "q"
    rc, _ = _quantize(capsys, "--weights", str(hf_dir), "--quantize", "int4-g32", "-o", str(q), "--device", "cpu")
    assert rc == 0
    rc, err = _quantize(capsys, "--weights", str(q), "--quantize", "int8", "-o", str(tmp_path / "qq"))
    assert rc == 2 and "quantize the original checkpoint instead" in err and "Traceback" not in err
    assert not (tmp_path / "qq").exists()


def test_the_source_directory_is_never_the_output(hf_dir, tmp_path, capsys):
    src = tmp_path / "src"
    shutil.copytree(hf_dir, src)
    before = sorted(p.name for p in src.iterdir())
    rc, err = _quantize(capsys, "--weights", str(src), "--quantize", "int8", "-o", str(src))
    assert rc == 2 and "is the source checkpoint" in err
    assert sorted(p.name for p in src.iterdir()) == before


def test_an_empty_or_foreign_output_directory_is_refused(hf_dir, tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    rc, err = _quantize(capsys, "--weights", str(hf_dir), "--quantize", "int8", "-o", "")
    assert rc == 2 and "-o ''" in err and list(tmp_path.iterdir()) == []
    other = tmp_path / "other"
    other.mkdir()
    (other / "notes.txt").write_text("mine")
    rc, err = _quantize(capsys, "--weights", str(hf_dir), "--quantize", "int8", "-o", str(other))
    assert rc == 2 and "holding other files" in err
    assert [p.name for p in other.iterdir()] == ["notes.txt"]


def test_a_previous_output_is_replaced_without_stale_tokenizer_files(hf_dir, tmp_path, capsys):
    out = tmp_path / "q"
    assert _quantize(capsys, "--weights", str(hf_dir), "--quantize", "int8", "-o", str(out), "--device", "cpu")[0] == 0
    (out / "tokenizer.json").write_text("{}")  # as if the earlier source had one
    assert _quantize(capsys, "--weights", str(hf_dir), "--quantize", "int8", "-o", str(out), "--device", "cpu")[0] == 0
    assert not (out / "tokenizer.json").exists()


def test_calibration_text_must_be_utf8_and_is_unused_by_rtn(hf_dir, tmp_path, capsys):
    bad = tmp_path / "latin.txt"
    bad.write_bytes(b"hello \xff\xfe world")
    rc, err = _quantize(capsys, "--weights", str(hf_dir), "--quantize", "int4-gptq-g32", "--calibration", str(bad),
                        "-o", str(tmp_path / "q"))
    assert rc == 2 and f"--calibration {bad}: not UTF-8 text (byte 0xff at offset 6)" in err
    good = tmp_path / "calib.txt"
    good.write_text(TEXT)
    out = tmp_path / "q8"
    rc, err = _quantize(capsys, "--weights", str(hf_dir), "--quantize", "int8", "--calibration", str(good),
                        "-o", str(out), "--device", "cpu")
    assert rc == 0 and "--calibration is not used" in err
    assert json.loads((out / "quantization.json").read_text())["scheme"].get("calibration") is None


def test_a_truncated_quantized_checkpoint_is_a_clear_error(hf_dir, tmp_path, capsys):
    q = tmp_path / "q"
    rc, _ = _quantize(capsys, "--weights", str(hf_dir), "--quantize", "int8", "-o", str(q), "--device", "cpu")
    assert rc == 0
    tensors = q / "model.safetensors"
    tensors.write_bytes(tensors.read_bytes()[: tensors.stat().st_size // 2])
    try:
        rc = main(["run", "--weights", str(q), "--prompt-ids", "1,2", "--max-tokens", "2", "--device", "cpu"])
    except SystemExit as e:
        rc = e.code
    err = capsys.readouterr().err
    assert rc == 2 and "not a readable safetensors file" in err and "run kiln quantize again" in err
    assert "Traceback" not in err
