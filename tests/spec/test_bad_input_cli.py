"""Hostile input through `kiln` (issue 16): every bad spec, flag or path is one message and exit 2, never a
traceback, and leaves nothing half-written; an internal failure is reported as a bug, not as a user error.

The table runs each row through kiln.cli.commands in-process. `{tmp}` in an argument is the test's tmp_path, where
the row's files are written first; after a failing row the files under it must be exactly those files.
"""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from kiln.cli import main

HEAD = 'model "m" {\n  vocab = 64 dim = 32 layers = 2 heads = 4 context = 16 norm = rms(eps = 1e-5) ffn = 64\n'
LAYER = "  layer {\n    x = x + attention(norm(x))\n    x = x + mlp(norm(x), act = swiglu)\n  }\n"
GOOD = HEAD + LAYER + "}\n"
HF_CONFIG = json.dumps({
    "model_type": "llama", "architectures": ["LlamaForCausalLM"], "hidden_size": 32, "intermediate_size": 64,
    "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 288,
    "max_position_embeddings": 64, "rms_norm_eps": 1e-5, "rope_theta": 10000.0,
})
# Root ignores permission bits, but not /sys; anyone else gets a directory without write permission.
ROOT = hasattr(os, "geteuid") and os.geteuid() == 0
LOCKED = "/sys" if ROOT else "{tmp}/locked"


def spec(setting: str = "", layer: str = LAYER, head: str = HEAD) -> str:
    """GOOD with `setting` added to the model block (or another layer block / head)."""
    return head + (f"  {setting}\n" if setting else "") + layer + "}\n"


def plus_chain(n: int) -> str:
    return " + ".join(["x"] * n)


@dataclass
class Row:
    id: str
    argv: list[str]
    code: int  # the exit status (argparse's own errors exit 2 through SystemExit)
    fragment: str  # in stderr (or stdout, for exit 0)
    files: dict[str, str | bytes] = field(default_factory=dict)  # written under {tmp} before the run
    once: bool = False  # the fragment appears exactly once


def check(text: str | bytes, **kw) -> dict:
    return {"argv": ["check", "{tmp}/s.kiln"], "files": {"s.kiln": text}, **kw}


ROWS = [
    # ---- spec files ----
    Row("binary-file", **check(b"\x89PNG\r\n\x1a\n\x00\x00\x00\rIHDR\xff\xfe"), code=2, fragment="binary file"),
    Row("latin1-file", **check(GOOD.replace("m", "\xe9").encode("latin-1")), code=2, fragment="not UTF-8 text"),
    Row("500-plus-terms", **check(spec(layer=f"  layer {{\n    x = {plus_chain(500)}\n  }}\n")), code=2,
        fragment="nested more than 100 levels"),
    Row("500-plus-in-setting", **check(spec("z = " + " + ".join(["1"] * 500))), code=2, fragment=":3:"),
    Row("1000-nested-calls", **check(spec("z = " + "f(" * 1000 + "1" + ")" * 1000)), code=2,
        fragment="nested more than 100 levels"),
    Row("1000-parens", **check(spec("z = " + "(" * 1000 + "1" + ")" * 1000)), code=2,
        fragment="unknown model setting `z`"),
    Row("vocab-10e30", **check(GOOD.replace("vocab = 64", "vocab = 1" + "0" * 30)), code=2,
        fragment="vocab = a 31-digit number is above the largest kiln can build"),
    Row("head-dim-huge", **check(spec("head_dim = 99999999999")), code=2,
        fragment="head_dim = 99999999999 is above the largest kiln can build, 256"),
    Row("head-size-from-dim", **check(GOOD.replace("dim = 32", "dim = 4096").replace("heads = 4", "heads = 2")),
        code=2, fragment="dim / heads = 2048 is the head size"),
    Row("2.6TB-model", **check(GOOD.replace("vocab = 64 dim = 32 layers = 2 heads = 4", "vocab = 128000 "
                                            "dim = 32768 layers = 75 heads = 256").replace("ffn = 64", "ffn = 131072")
                               + "compile {\n  dtype = bf16\n}\n"),
        code=2, fragment="has 1.3T parameters, 2.4 TiB in bf16: above the 1.0 TiB of weights any one device can hold"),
    Row("layers-1e8", **check(GOOD.replace("layers = 2", "layers = 100000000")), code=2,
        fragment="layers = 100000000 is above the largest kiln can build, 1024"),
    Row("context-huge", **check(GOOD.replace("context = 16", "context = 99999999999")), code=2,
        fragment="context = 99999999999 is above"),
    Row("window-huge", **check(spec(layer=LAYER.replace("norm(x))", "norm(x), window = 99999999999)", 1))),
        code=2, fragment="window = 99999999999 is above"),
    Row("eps-1e999", **check(GOOD.replace("1e-5", "1e999")), code=2, fragment="beyond the floating-point range"),
    Row("theta-1e999", **check(spec("rope = rope(theta = 1e999)")), code=2, fragment="reads as infinity"),
    Row("eps-1e30", **check(GOOD.replace("1e-5", "1e30")), code=2,
        fragment="eps = 1e+30 is above the largest kiln accepts, 1"),
    Row("theta-1e300", **check(spec("rope = rope(theta = 1e300)")), code=2, fragment="overflow in fp32"),
    Row("eps-400-digit-int", **check(GOOD.replace("1e-5", "1" + "0" * 400)), code=2,
        fragment="eps is too large to be a finite number"),
    Row("5000-digit-number", **check(GOOD.replace("vocab = 64", "vocab = " + "9" * 5000)), code=2,
        fragment="number with 5000 digits is too long"),
    Row("bom-accepted", **check("\ufeff" + GOOD), code=0, fragment="ok (m, 2 layers"),
    Row("nul-byte", **check(GOOD.replace("layers = 2", "layers = 2\x00")), code=2,
        fragment="s.kiln:2:33: error: unexpected character U+0000 (a control character)"),
    Row("nbsp", **check(GOOD.replace("layers = 2 ", "layers = 2\u00a0")), code=2,
        fragment="U+00A0 (NO-BREAK SPACE)"),
    Row("zero-width-space", **check(GOOD.replace("layers", "\u200blayers")), code=2,
        fragment="s.kiln:2:23: error: unexpected character U+200B (ZERO WIDTH SPACE)"),
    Row("number-without-leading-digit", **check(GOOD.replace("1e-5", ".00001")), code=2,
        fragment="hint: a number starts with a digit: write 0.00001, not .00001"),
    Row("curly-quotes", **check(GOOD.replace('"m"', "\u201cm\u201d")), code=2,
        fragment="U+201C (LEFT DOUBLE QUOTATION MARK)"),
    Row("x-times-x-times-x", **check(spec(layer="  layer {\n    x = x * x * x\n  }\n")), code=2,
        fragment="operator `*` is not supported", once=True),
    Row("check-a-directory", ["check", "{tmp}"], code=2, fragment="is a directory, not a spec file"),
    Row("fmt-binary", ["fmt", "--write", "{tmp}/s.kiln"], files={"s.kiln": b"\x00\xff\x00"}, code=2,
        fragment="not UTF-8 text"),
    Row("fmt-nul", ["fmt", "{tmp}/s.kiln"], files={"s.kiln": "model \x00"}, code=2, fragment="U+0000"),
    # ---- flags ----
    Row("seed-huge", ["run", "--prompt", "x", "--seed", "99999999999999999999999"], code=2,
        fragment="argument --seed: must be an integer from 0 to 2**64 - 1"),
    Row("seed-negative", ["run", "--prompt", "x", "--seed", "-1"], code=2, fragment="argument --seed"),
    Row("bench-seed-huge", ["bench", "throughput", "--seed", "1" + "0" * 25], code=2, fragment="argument --seed"),
    Row("bench-num-requests-0", ["bench", "throughput", "--num-requests", "0"], code=2,
        fragment="argument --num-requests: must be at least 1"),
    Row("bench-positions-0", ["bench", "quality", "--positions", "0"], code=2, fragment="argument --positions"),
    Row("bench-schemes-bogus", ["bench", "quality", "--schemes", "int8,bogus"], code=2,
        fragment="--schemes: 'bogus' is not a quantization scheme"),
    Row("temperature-nan", ["run", "--prompt", "x", "--temperature", "nan"], code=2,
        fragment="--temperature nan is out of range"),
    Row("prompt-ids-garbage", ["run", "--prompt-ids", "1,two"], code=2,
        fragment="argument --prompt-ids: --prompt-ids must be comma-separated integers"),
    Row("block-size-3", ["run", "--prompt", "x", "--max-tokens", "1", "--block-size", "3"], code=2,
        fragment="--block-size 16"),
    Row("device-unknown", ["run", "--prompt", "x", "--device", "tpu"], code=2, fragment="unknown device 'tpu'"),
    Row("eval-text-missing", ["bench", "quality", "--eval-text", "{tmp}/nope.txt"], code=2,
        fragment="--eval-text {tmp}/nope.txt: no such file"),
    Row("calibration-a-directory", ["quantize", "--quantize", "int8", "--calibration", "{tmp}", "-o", "{tmp}/q"],
        code=2, fragment="--calibration {tmp}: is not a regular file"),
    Row("quantize-bogus", ["compile", "tiny-llama", "--quantize", "int3"], code=2,
        fragment="quantize 'int3' (--quantize)"),
    # ---- output paths ----
    Row("import-o-missing-dir", ["import", "{tmp}/hf", "-o", "{tmp}/missing/m.kiln"],
        files={"hf/config.json": HF_CONFIG}, code=2, fragment="-o {tmp}/missing/m.kiln: the directory"),
    Row("import-o-under-a-file", ["import", "{tmp}/hf", "-o", "{tmp}/afile/m.kiln"],
        files={"hf/config.json": HF_CONFIG, "afile": "x"}, code=2, fragment="afile is a file, not a directory"),
    Row("import-o-a-directory", ["import", "{tmp}/hf", "-o", "{tmp}/hf"], files={"hf/config.json": HF_CONFIG},
        code=2, fragment="-o {tmp}/hf: is a directory; give a file name"),
    Row("import-o-unwritable", ["import", "{tmp}/hf", "-o", f"{LOCKED}/m.kiln"],
        files={"hf/config.json": HF_CONFIG}, code=2, fragment="cannot write in"),
    Row("import-o-ok", ["import", "{tmp}/hf", "-o", "{tmp}/m.kiln"], files={"hf/config.json": HF_CONFIG},
        code=0, fragment="kiln: wrote {tmp}/m.kiln"),
    Row("emit-to-a-file", ["compile", "tiny-llama", "--emit", "{tmp}/afile"], files={"afile": "x"}, code=2,
        fragment="--emit {tmp}/afile: is a file, not a directory"),
    Row("emit-missing-parent", ["compile", "tiny-llama", "--emit", "{tmp}/missing/out"], code=2,
        fragment="--emit {tmp}/missing/out: the directory {tmp}/missing does not exist"),
    Row("emit-unwritable", ["compile", "tiny-llama", "--emit", f"{LOCKED}/out"], code=2, fragment="cannot write in"),
    Row("quantize-o-a-file", ["quantize", "--quantize", "int8", "-o", "{tmp}/afile"], files={"afile": "x"}, code=2,
        fragment="-o {tmp}/afile: is a file, not a directory"),
    Row("quantize-o-missing-parent", ["quantize", "--quantize", "int8", "-o", "{tmp}/missing/q"], code=2,
        fragment="does not exist; create it first"),
    Row("quantize-o-unwritable", ["quantize", "--quantize", "int8", "-o", f"{LOCKED}/q"], code=2,
        fragment="cannot write in"),
]


def _tree(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


def run_main(argv: list[str], capsys) -> tuple[int, str, str]:
    try:
        code = main(argv)
    except SystemExit as e:  # argparse rejects a flag value itself
        code = e.code
    out, err = capsys.readouterr()
    return code, out, err


@pytest.mark.parametrize("row", ROWS, ids=[r.id for r in ROWS])
def test_bad_input_is_one_message_and_exit_2(row: Row, tmp_path, capsys):
    for name, content in row.files.items():
        path = tmp_path / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(content if isinstance(content, bytes) else content.encode())
    if not ROOT:
        (tmp_path / "locked").mkdir(mode=0o500)
    before = _tree(tmp_path)
    code, out, err = run_main([a.replace("{tmp}", str(tmp_path)) for a in row.argv], capsys)
    fragment = row.fragment.replace("{tmp}", str(tmp_path))
    text = err if row.code else out + err
    assert code == row.code, err
    assert fragment in text
    assert "Traceback" not in out + err
    if row.once:
        assert text.count(fragment) == 1
    if row.code:
        assert _tree(tmp_path) == before, "a failed command wrote or changed files"
        assert not list(tmp_path.rglob("*.tmp")), "a failed command left a temporary file"


def test_the_table_covers_enough_rows():
    assert len(ROWS) >= 35 and len({r.id for r in ROWS}) == len(ROWS)


def test_a_huge_file_given_as_a_spec_is_refused_unread(tmp_path, capsys):
    big = tmp_path / "model.safetensors"
    with big.open("wb") as f:
        f.truncate(17 << 20)  # sparse: costs no disk
    code, _, err = run_main(["check", str(big)], capsys)
    assert code == 2 and "17 MiB is far too large for a spec file" in err and "Traceback" not in err


def test_path_and_flag_errors_are_usage_errors(tmp_path):
    from kiln.cli.paths import check_output_file
    from kiln.errors import KilnError, UsageError
    from kiln.spec.loader import load_spec

    assert issubclass(UsageError, KilnError)
    with pytest.raises(UsageError, match="is a directory, not a spec file"):
        load_spec(tmp_path)
    with pytest.raises(UsageError, match="-o .*: the directory .* does not exist"):
        check_output_file("-o", str(tmp_path / "no" / "x.kiln"))


def test_check_goes_on_after_a_file_it_cannot_read(tmp_path, capsys):
    code, out, err = run_main(["check", str(tmp_path), "tiny-llama"], capsys)
    assert code == 2 and "is a directory, not a spec file" in err and "ok (tiny-llama" in out


def test_check_reports_parameters_and_weight_bytes(capsys):
    from kiln.model_config import param_shapes
    from kiln.spec.limits import param_count
    from kiln.spec.loader import bundled_specs, load_spec

    for name in bundled_specs():
        model = load_spec(name).model
        assert param_count(model) == sum(torch_numel(s) for s in param_shapes(model).values())
    code, out, _ = run_main(["check", "llama-3.1-8b", "tiny-llama"], capsys)
    assert code == 0
    assert "ok (llama-3.1-8b, 32 layers, 8.0B parameters, 15.0 GiB of weights in bf16)" in out
    assert "ok (tiny-llama, 2 layers, 139.6K parameters, 545.2 KiB of weights in fp32)" in out


def torch_numel(shape: tuple[int, ...]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


# ---- the error contract ----------------------------------------------------------------------------------


def test_an_internal_error_is_a_bug_not_exit_2(monkeypatch, capsys):
    def broken(ref):
        raise ZeroDivisionError("boom inside kiln")

    monkeypatch.setattr("kiln.cli.spec_files.load_spec", broken)
    code, _, err = run_main(["check", "tiny-llama"], capsys)
    assert code == 1 and code != 2
    assert "Traceback" in err and "ZeroDivisionError: boom inside kiln" in err
    assert err.rstrip().splitlines()[-1].startswith("kiln: this is a bug in kiln")
    with pytest.raises(ZeroDivisionError):
        main(["--debug", "check", "tiny-llama"])


def test_debug_shows_the_traceback_of_a_user_error(tmp_path, capsys):
    (tmp_path / "s.kiln").write_text(GOOD.replace("layers = 2", "layers = 0"))
    for argv in (["--debug", "compile", str(tmp_path / "s.kiln")], ["compile", str(tmp_path / "s.kiln"), "--debug"]):
        code, _, err = run_main(argv, capsys)
        assert code == 2  # a user error under --debug exits 2, as without it
        assert "Traceback" in err and "SpecError" in err and "layers must be a positive integer" in err


def test_broken_pipe_exits_quietly():
    cmd = [sys.executable, "-m", "kiln", "run", "--prompt-ids", "1,2", "--max-tokens", "40", "--temperature", "0",
           "--num-blocks", "8"]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    first = proc.stdout.read(1)  # the reader takes one byte and goes away, as `| head -c 1` does
    proc.stdout.close()
    err = proc.stderr.read().decode()
    assert proc.wait(timeout=300) == 141, err
    assert first
    assert "Traceback" not in err and "BrokenPipe" not in err and "Exception ignored" not in err


def test_successful_writes_are_whole(tmp_path, capsys):
    out = tmp_path / "emit"
    code, _, err = run_main(["compile", "tiny-llama", "--emit", str(out)], capsys)
    assert code == 0, err
    assert (out / "graphs").is_dir() and list((out / "kernels").glob("*.py"))
    assert [p.name for p in tmp_path.iterdir()] == ["emit"]  # the staging directory is gone


# ---- spec diagnostics stay linear --------------------------------------------------------------------------


class _CountingStr(str):
    splits = 0

    def split(self, *args, **kw):
        type(self).splits += 1
        return super().split(*args, **kw)


def test_many_unknown_keys_are_diagnosed_in_linear_time():
    from kiln.errors import SpecError
    from kiln.spec.parser import parse_spec
    from kiln.spec.validate import resolve

    n = 20_000
    text = HEAD + "".join(f"  unknown_{i} = {i}\n" for i in range(n)) + LAYER + "}\n"
    ast = parse_spec(text, "many.kiln")
    ast = dataclasses.replace(ast, source=_CountingStr(ast.source))
    with pytest.raises(SpecError) as info:
        resolve(ast)
    assert len(info.value.diagnostics) == n
    assert info.value.diagnostics[-1].source_line == f"  unknown_{n - 1} = {n - 1}"
    # The source is split once, not once per diagnostic (that made 32k keys take minutes). No timing is
    # asserted (tests never do); this whole test takes a few seconds.
    assert _CountingStr.splits == 1


# ---- kernel cache hygiene ------------------------------------------------------------------------------------


def _act_params():
    return dict(op="gated_act", tile={"BLOCK_SIZE": 1024, "num_warps": 4}, params={"ACT": "silu", "GATED": True})


def test_cache_removes_stale_temp_files_but_not_fresh_ones(tmp_path):
    from kiln.codegen.cache import STALE_TMP_S, KernelCache

    stale, fresh = tmp_path / "act_dead.tmp", tmp_path / "act_writing.tmp"
    stale.write_text("half a kern")
    fresh.write_text("being written")
    old = time.time() - STALE_TMP_S - 60
    os.utime(stale, (old, old))
    cache = KernelCache(tmp_path)
    cache.load("act", "act_kernel", **_act_params())
    assert not stale.exists() and fresh.exists()
    assert cache.stats.stale_tmp_removed == 1


def test_cache_replaces_a_corrupt_file_with_a_note(tmp_path, caplog):
    from kiln.codegen.cache import KernelCache

    KernelCache(tmp_path).load("act", "act_kernel", **_act_params())
    (path,) = tmp_path.glob("act_*.py")
    whole = path.read_text()
    path.write_text(whole[: len(whole) // 2])  # a writer killed mid-copy, or a disk error
    cache = KernelCache(tmp_path)
    with caplog.at_level("WARNING", logger="kiln"):
        fn = cache.load("act", "act_kernel", **_act_params())
    assert fn.fn.__name__ == "act_kernel"
    assert path.read_text() == whole
    assert cache.stats.repaired == 1 and cache.stats.renders == cache.stats.misses == 1 and cache.stats.hits == 0
    assert any("is corrupt" in r.getMessage() and str(path) in r.getMessage() for r in caplog.records)


def test_cache_repair_note_reaches_stderr_through_the_cli_logger(tmp_path, capsys):
    from kiln.cli.common import setup_logging
    from kiln.codegen.cache import KernelCache

    setup_logging()
    KernelCache(tmp_path).load("act", "act_kernel", **_act_params())
    (path,) = tmp_path.glob("act_*.py")
    path.write_text("def act_kernel(:\n")
    capsys.readouterr()
    KernelCache(tmp_path).load("act", "act_kernel", **_act_params())
    err = capsys.readouterr().err
    assert f"kiln: kernel cache file {path} is corrupt" in err


@pytest.mark.parametrize(("dir_mode", "file_mode"), [(0o750, 0o640), (0o700, 0o600), (0o755, 0o644)])
def test_cache_files_take_the_directory_read_bits(tmp_path, dir_mode, file_mode):
    from kiln.codegen.cache import KernelCache

    root = tmp_path / "cache"
    root.mkdir()
    root.chmod(dir_mode)
    KernelCache(root).load("act", "act_kernel", **_act_params())
    (path,) = root.glob("act_*.py")
    assert path.stat().st_mode & 0o777 == file_mode
