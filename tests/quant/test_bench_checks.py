"""`kiln bench perplexity` / `bench quality`: inputs that would give false figures or crash are refused with a clear
message (a `kiln quantize` output, a window past the context, text that is not UTF-8, too few tokens), defaults
adapt to the model, and the JSON says where and with what it was measured."""

from __future__ import annotations

import io
import logging

import pytest

from kiln.cli.commands import main
from kiln.cli.perplexity import run_perplexity
from kiln.cli.quality import bench_quality_main
from kiln.errors import KilnError

TEXT = "the other one in the north, then another one over the river. " * 6  # 372 bytes: byte-level tokens


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    d = tmp_path_factory.mktemp("texts")
    (d / "text.txt").write_text(TEXT)
    (d / "latin.txt").write_bytes(b"hello \xff\xfe world")
    (d / "empty.txt").write_text("")
    q = d / "q"
    assert main(["quantize", "tiny-llama", "--quantize", "int4-g32", "-o", str(q), "--device", "cpu"]) == 0
    return d


def test_a_kiln_quantized_checkpoint_is_refused(files):
    with pytest.raises(KilnError, match="is a `kiln quantize` output .int4-rtn-g32.; bench perplexity needs "
                       "full-precision weights"):
        run_perplexity(None, files / "q", files / "text.txt", variants=["fp32"], device="cpu")
    with pytest.raises(KilnError, match="bench quality needs full-precision weights"):
        bench_quality_main(None, str(files / "q"), schemes=["int8"], positions=32, device="cpu", out=io.StringIO())


def test_the_window_never_passes_the_context(files):
    notes = []
    r = run_perplexity("tiny-gpt2", None, files / "text.txt", variants=["fp32"], device="cpu", progress=notes.append)
    assert r["window"] == 256 and r["variants"]["fp32"]["scored_tokens"] == len(TEXT) - 2  # two windows
    assert any("--window defaults to 512 tokens; using 256" in n for n in notes)
    with pytest.raises(KilnError, match="--window 1000: give 2 to 256 tokens"):
        run_perplexity("tiny-llama", None, files / "text.txt", variants=["fp32"], window=1000, device="cpu")


def test_bad_texts_and_token_counts_are_clear_errors(files):
    with pytest.raises(KilnError, match=r"--text .*latin.txt: not UTF-8 text \(byte 0xff at offset 6\)"):
        run_perplexity("tiny-llama", None, files / "latin.txt", variants=["fp32"], device="cpu")
    with pytest.raises(KilnError, match=r"--calibration .*latin.txt: not UTF-8"):
        run_perplexity("tiny-llama", None, files / "text.txt", variants=["int4-gptq-g32"], device="cpu",
                       calibration=str(files / "latin.txt"))
    with pytest.raises(KilnError, match="0 token.s.; perplexity needs at least 2"):
        run_perplexity("tiny-llama", None, files / "empty.txt", variants=["fp32"], device="cpu")
    for n in (0, 1):
        with pytest.raises(KilnError, match=f"--max-tokens {n}: give at least 2"):
            run_perplexity("tiny-llama", None, files / "text.txt", variants=["fp32"], max_tokens=n, device="cpu")


def test_perplexity_json_weights_is_null_and_unused_calibration_is_noted(files):
    notes = []
    r = run_perplexity("tiny-llama", None, files / "text.txt", variants=["fp32"], window=64, device="cpu",
                       calibration=str(files / "text.txt"), progress=notes.append)
    assert r["weights"] is None
    assert any("--calibration is not used" in n for n in notes)


def test_quality_defaults_adapt_to_the_model_and_json_says_where(caplog):
    caplog.set_level(logging.INFO, logger="kiln.status")  # the note is a status line (kiln.progress.say)
    rep = bench_quality_main("tiny-llama", positions=32, device="cpu", json=True, out=io.StringIO())
    assert [r["error"] for r in rep["rows"]] == [None] * len(rep["rows"])
    assert [r["scheme"] for r in rep["rows"]] == ["int8", "int4-rtn-g64", "int4-gptq-g64"]
    assert "int4-rtn-g128 cannot apply" in caplog.text
    assert {"device", "torch", "triton", "commit", "date"} <= set(rep)


def test_quality_positions_message_says_the_rule():
    with pytest.raises(KilnError, match="--positions 200: evaluated in rows of 128 tokens.*give at most 128 or a "
                       "multiple of 128"):
        bench_quality_main("tiny-llama", schemes=["int8"], positions=200, device="cpu", out=io.StringIO())
