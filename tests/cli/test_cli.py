"""The `kiln` command line, run in-process through kiln.cli.commands (and once as the installed console script)."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from kiln.cli.commands import main
from kiln.spec.loader import bundled_specs

SPECS = Path(__file__).resolve().parents[2] / "specs"


def run_cli(capsys, *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def test_run_default_spec_json(capsys):
    code, out, err = run_cli(capsys, "run", "--prompt", "Hello", "--max-tokens", "5", "--seed", "3", "--json")
    assert code == 0
    result = json.loads(out)
    assert len(result["token_ids"]) == 5
    assert result["prompt_token_ids"] == list(b"Hello")
    assert result["ttft_s"] > 0 and result["decode_tokens_per_s"] > 0
    # the default spec's tokenizer is byte-level: ids 0-255 are UTF-8 bytes, higher ids have no text
    want = bytes(t for t in result["token_ids"] if t < 256).decode("utf-8", errors="replace")
    assert want and result["text"] == want
    assert "time to first token" in err and "tokens/s" in err


def test_one_token_has_no_decode_rate(capsys):
    code, out, err = run_cli(capsys, "run", "--prompt", "Hello", "--max-tokens", "1", "--seed", "3", "--json")
    assert code == 0 and json.loads(out)["decode_tokens_per_s"] is None
    assert "no decode rate (one token)" in err and "0.0 tokens/s" not in err


def test_run_greedy_is_deterministic_and_seeded_sampling_repeats(capsys):
    argv = ["run", "tiny-llama", "--prompt-ids", "1,2,3,4", "--max-tokens", "6", "--json"]
    first = json.loads(run_cli(capsys, *argv, "--temperature", "0")[1])["token_ids"]
    second = json.loads(run_cli(capsys, *argv, "--temperature", "0")[1])["token_ids"]
    assert first == second
    a = json.loads(run_cli(capsys, *argv, "--seed", "7")[1])["token_ids"]
    b = json.loads(run_cli(capsys, *argv, "--seed", "7")[1])["token_ids"]
    assert a == b


def test_run_stop_text_ends_generation_before_it(capsys):
    argv = ["run", "tiny-llama", "--prompt-ids", "104,105", "--max-tokens", "24", "--temperature", "0", "--json"]
    full = json.loads(run_cli(capsys, *argv)[1])
    text = full["text"]
    # two characters of the greedy output after its first one (none a byte the tokenizer could not decode)
    stop = next(text[i:i + 2] for i in range(1, len(text) - 1) if "\ufffd" not in text[i:i + 2])
    assert full["finish_reason"] == "length"
    cut = json.loads(run_cli(capsys, *argv, "--stop", "never-there", "--stop", stop)[1])
    assert cut["text"] == full["text"][: full["text"].index(stop)]
    assert (cut["finish_reason"], cut["stop_reason"]) == ("stop", stop)


def test_run_plain_text_goes_to_stdout(capsys):
    code, out, err = run_cli(capsys, "run", "--prompt", "ab", "--max-tokens", "3", "--temperature", "0")
    assert code == 0
    assert out.endswith("\n")
    assert "loaded tiny-llama" in err
    # random weights never pass for loaded ones (a copied spec of a bundled model loses its packaged weights)
    assert "(fp32, random weights (seed 0; give --weights for real ones))" in err


@pytest.mark.parametrize(
    ("flag", "value", "needle"),
    [("--temperature", "-1", "--temperature -1.0"), ("--top-p", "0", "--top-p 0.0"),
     ("--max-tokens", "0", "--max-tokens 0")],
)
def test_run_bad_sampling_parameter_is_a_clean_error(capsys, flag, value, needle):
    code, out, err = run_cli(capsys, "run", "--prompt", "x", flag, value)
    assert code == 2
    assert needle in err
    assert "Traceback" not in err


def test_run_prompt_longer_than_context_is_a_clean_error(capsys):
    ids = ",".join(["5"] * 250)  # tiny-llama's context is 256
    code, _, err = run_cli(capsys, "run", "--prompt-ids", ids, "--max-tokens", "10")
    assert code == 2
    assert "256" in err and "--max-tokens" in err


def test_debug_flag_shows_the_exception(capsys):
    # a user error under --debug: the traceback, and still exit 2 (it used to re-raise: exit 1, as for a bug);
    # --debug after the subcommand works too
    for argv in (["--debug", "run"], ["run", "--debug"]):
        code, _, err = run_cli(capsys, *argv, "--prompt", "x", "--temperature", "-1")
        assert code == 2 and "Traceback" in err and "temperature" in err.splitlines()[-1]


def test_check_bundled_specs_ok(capsys):
    code, out, _ = run_cli(capsys, "check", *bundled_specs())
    assert code == 0
    assert out.count(": ok") == len(bundled_specs())


def test_check_reports_every_error_in_a_file(capsys, tmp_path):
    bad = tmp_path / "bad.kiln"
    bad.write_text(
        'model "bad" {\n'
        "  vocab = 0\n"
        "  dim = 64 layers = 2 heads = 4 kv_heads = 3 ffn = 128 context = 64\n"
        "  norm = rms(eps = 1e-5)\n"
        "  layer {\n"
        "    x = x + attention(norm(x), window = 0)\n"
        "    x = x + mlp(norm(x), act = swiglu)\n"
        "  }\n"
        "}\n"
    )
    code, _, err = run_cli(capsys, "check", str(bad))
    assert code == 2
    assert f"{bad}:2:" in err  # vocab = 0
    assert f"{bad}:3:" in err  # heads not divisible by kv_heads
    assert f"{bad}:6:" in err  # window < 1
    assert "3 errors" in err


def test_fmt_prints_canonical_form_and_check_mode(capsys, tmp_path):
    messy = tmp_path / "messy.kiln"
    messy.write_text((SPECS / "tiny-llama.kiln").read_text().replace("  ", "      "))
    code, out, _ = run_cli(capsys, "fmt", str(messy))
    assert code == 0
    assert out == main_fmt_of(SPECS / "tiny-llama.kiln", capsys)
    assert run_cli(capsys, "fmt", "--check", str(messy))[0] == 1
    assert run_cli(capsys, "fmt", "--write", str(messy))[0] == 0
    assert run_cli(capsys, "fmt", "--check", str(messy))[0] == 0


def main_fmt_of(path: Path, capsys) -> str:
    assert main(["fmt", str(path)]) == 0
    return capsys.readouterr()[0]


def test_compile_dump_ir_of_the_8b_spec_costs_no_memory(capsys):
    code, out, err = run_cli(capsys, "compile", "llama-3.1-8b", "--dump-ir", "--dtype", "bf16")
    assert code == 0
    sections = {s.split("\n", 1)[0]: s for s in out.split("# ")[1:]}  # one per graph: frontend, every pass
    level1 = sections["llama-3.1-8b: Level-1 graph (frontend)"]
    assert level1.count("kiln.attention(") == 32
    assert "bf16[1, 8, 4096]" in level1  # a hidden state with its shape
    assert "weight layers.31.mlp0.down.weight" in level1
    assert sections["after flash_tiling"].count("kiln.flash_attention(") == 32
    assert "weight layers.31.attn0.qkv.weight" in sections["after gqa_fusion"]
    gib = float(err.split("ops, ")[1].split(" MiB")[0]) / 1024
    assert 14.5 < gib < 15.5  # 8.03 B parameters in bf16


def test_unknown_spec_name_lists_bundled_specs(capsys):
    code, _, err = run_cli(capsys, "compile", "no-such-model")
    assert code == 2
    assert "tiny-llama" in err


def test_console_script_is_installed():
    exe = shutil.which("kiln", path=str(Path(sys.executable).parent))
    assert exe is not None, "the `kiln` console script is not installed next to this python"
    for argv in (["--help"], ["run", "--help"], ["check", "--help"], ["fmt", "--help"], ["import", "--help"],
                 ["compile", "--help"]):
        res = subprocess.run([exe, *argv], capture_output=True, text=True, timeout=120)
        assert res.returncode == 0, res.stderr
        assert "usage: kiln" in res.stdout


def test_run_with_quantize_flag_and_bad_scheme(capsys):
    code, out, err = run_cli(capsys, "run", "--quantize", "int4-g32", "--prompt-ids", "1,2,3", "--max-tokens", "4",
                             "--temperature", "0", "--json")
    assert code == 0
    assert len(json.loads(out)["token_ids"]) == 4
    code, _, err = run_cli(capsys, "run", "--quantize", "int5", "--prompt", "x")
    assert code == 2
    assert "quantize 'int5' (--quantize)" in err and "int8" in err


def test_compile_reports_quantized_weight_bytes(capsys):
    code, _, plain = run_cli(capsys, "compile", "llama-3.2-1b", "--dtype", "bf16")
    assert code == 0
    code, _, quant = run_cli(capsys, "compile", "llama-3.2-1b", "--dtype", "bf16", "--quantize", "int4-g128")
    assert code == 0
    assert "passes: gqa_fusion, quantize" in quant
    ratio = float(quant.split("MiB dense (embeddings, norms, unquantized); ")[1].split("x the bf16")[0])
    assert 0.3 < ratio < 0.5  # linears at ~1/4 plus scales; the 128256 x 2048 embedding stays bf16


def test_bench_quality_table(capsys):
    code, out, _ = run_cli(capsys, "bench", "quality", "tiny-llama", "--positions", "32", "--schemes", "int8,int4-g32")
    assert code == 0
    assert "int8" in out and "int4-rtn-g32" in out and "top-1" in out


def test_quantize_once_then_run_from_the_saved_checkpoint(capsys, tmp_path):
    out = tmp_path / "q"
    code, _, err = run_cli(capsys, "quantize", "tiny-llama", "--quantize", "int4-gptq-g32", "-o", str(out))
    assert code == 0 and "calibrating" in err
    assert (out / "model.safetensors").is_file() and (out / "quantization.json").is_file()
    argv = ["--prompt-ids", "1,2,3,4", "--max-tokens", "6", "--temperature", "0", "--json"]
    saved = json.loads(run_cli(capsys, "run", "--weights", str(out), *argv)[1])["token_ids"]
    fresh = json.loads(run_cli(capsys, "run", "tiny-llama", "--quantize", "int4-gptq-g32", *argv)[1])["token_ids"]
    assert saved == fresh  # loading reproduces the calibrated weights exactly; nothing is calibrated again
    code, _, err = run_cli(capsys, "run", "--weights", str(out), *argv)
    assert "calibrating" not in err
    assert "(fp32, int4-gptq-g32)" in err  # the load line names the stored scheme


def test_run_with_int8_kv_cache_and_the_specs_block_size(capsys, tmp_path):
    spec = tmp_path / "blocky.kiln"
    spec.write_text((SPECS / "tiny-llama.kiln").read_text().replace("  dtype = fp32\n", "  dtype = fp32\n"
                                                                      "  kv_cache = paged(block = 4)\n"))
    argv = ["--prompt-ids", "5,6,7,8,9", "--max-tokens", "8", "--temperature", "0", "--json"]
    base = json.loads(run_cli(capsys, "run", "tiny-llama", *argv)[1])["token_ids"]
    blocky = json.loads(run_cli(capsys, "run", str(spec), *argv)[1])["token_ids"]
    assert blocky == base  # the block size changes the memory layout, never the result
    code, out, _ = run_cli(capsys, "run", "tiny-llama", "--kv-cache-dtype", "int8", *argv)
    assert code == 0
    assert len(json.loads(out)["token_ids"]) == 8
    code, _, err = run_cli(capsys, "run", str(spec), "--block-size", "3", *argv)
    assert code == 2 and "block" in err
