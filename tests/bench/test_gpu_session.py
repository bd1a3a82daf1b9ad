"""bench/gpu/: the scripted GPU session. Its commands must run first time on the GPU machine, so every benchmark it
names exists and takes the flags it is given, the shell script parses, and collect.py reports failures."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.support.bench_scripts import load_script

ROOT = Path(__file__).resolve().parents[2]
SESSION = ROOT / "bench" / "gpu" / "session.sh"


def test_session_script_parses():
    subprocess.run(["bash", "-n", str(SESSION)], check=True)


@pytest.mark.parametrize("script", sorted(set(re.findall(r"bench/(\w+)\.py", SESSION.read_text()))))
def test_every_benchmark_the_session_runs_takes_its_flags(script):
    text = SESSION.read_text()
    flags = set()
    for line in text.splitlines():
        if f"bench/{script}.py" in line:
            flags |= set(re.findall(r"(--[a-z][a-z0-9-]*)", line.split(f"bench/{script}.py", 1)[1]))
    path = ROOT / "bench" / f"{script}.py"
    assert path.exists(), f"session.sh runs bench/{script}.py, which does not exist"
    out = subprocess.run([sys.executable, str(path), "--help"], capture_output=True, text=True, cwd=ROOT,
                         timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    missing = [f for f in sorted(flags) if f not in out.stdout]
    assert not missing, f"bench/{script}.py --help does not offer {missing}"


def test_collect_copies_results_and_names_failures(tmp_path, monkeypatch):

    mod = load_script("gpu/collect.py", monkeypatch)
    monkeypatch.setattr(mod, "RESULTS", tmp_path / "dest")
    (tmp_path / "dest").mkdir()
    src = tmp_path / "at"
    (src / "results").mkdir(parents=True)
    (src / "results" / "attention-x-2026.json").write_text("{}")
    (src / "results" / "gpu-tests-x-2026.xml").write_text(
        '<testsuites><testsuite tests="3" failures="1" errors="0" skipped="0"/></testsuites>')
    (src / "status.txt").write_text("pytest-gpu rc=0 420s-limit took=30s\nquant rc=1 150s-limit took=9s\n")
    assert mod.main([str(src)]) == 1
    assert sorted(p.name for p in (tmp_path / "dest").iterdir()) == ["attention-x-2026.json", "gpu-tests-x-2026.xml"]
    (src / "status.txt").write_text("pytest-gpu rc=0 420s-limit took=30s\n")
    assert mod.main([str(src)]) == 0


def test_serving_vs_hf_runs_a_trace_that_fits_its_limit():
    # 64 requests took about 140 s on the H100 (GPU.md); the script's default of 256 would pass its 260 s limit
    [line] = [ln for ln in SESSION.read_text().splitlines() if "bench/serving_vs_hf.py" in ln]
    assert int(re.search(r"--num-requests (\d+)", line).group(1)) <= 64 and re.search(r"run serving_vs_hf 260 ", line)


def test_collect_names_errors_recorded_in_result_files(tmp_path, monkeypatch, capsys):
    """A script that records a failing row and goes on exits 1, and collect.py names the error from its JSON."""
    import json

    mod = load_script("gpu/collect.py", monkeypatch)
    monkeypatch.setattr(mod, "RESULTS", tmp_path / "dest")
    (tmp_path / "dest").mkdir()
    src = tmp_path / "at"
    (src / "results").mkdir(parents=True)
    (src / "status.txt").write_text("decode rc=0 290s-limit took=200s\n")
    clean = {"rows": [{"seq": 1024, "kiln_ms": 1.0}], "mismatches": [], "errors": [], "status": "complete"}
    (src / "results" / "attention-x.json").write_text(json.dumps(clean))
    assert mod.main([str(src)]) == 0
    (src / "results" / "decode-x.json").write_text(json.dumps(
        {"rows": [{"prompt_len": 64, "kiln_tok_s": 1.0}, {"prompt_len": 2048, "error": "RuntimeError: OOM"}],
         "errors": ["llama prompt 2048: RuntimeError: OOM"]}))
    (src / "results" / "attention-y.json").write_text(json.dumps({"rows": [{"kiln_tma_error": "mismatch 3.5"}]}))
    (src / "results" / "torch_backend-x.json").write_text(json.dumps(
        {"errors": {"kiln-ro": "RuntimeError: capture"}, "mismatches": ["kiln prefill: relative error 1e-1"]}))
    (src / "results" / "serving_vs_hf-x.json").write_text(json.dumps({"status": "partial: hf measured"}))
    assert mod.main([str(src)]) == 1
    out = capsys.readouterr().out
    assert "ERROR in decode-x.json: rows[1].error: RuntimeError: OOM" in out
    assert out.count("ERROR in decode-x.json") == 1  # its "errors" list repeats the row: named once
    assert "ERROR in attention-y.json: rows[0].kiln_tma_error: mismatch 3.5" in out
    assert "ERROR in torch_backend-x.json: errors.kiln-ro: RuntimeError: capture" in out
    assert "ERROR in torch_backend-x.json: mismatches: kiln prefill" in out
    assert "ERROR in serving_vs_hf-x.json: status: partial: hf measured" in out
    assert "attention-x.json" not in out.replace("copied attention-x.json", "")


def test_a_phase_brings_back_few_files_and_collect_reads_the_packed_logs(tmp_path, monkeypatch, capsys):
    """The device tool brings back at most 8 files from $OUT: session.sh packs its logs into one archive (here the
    `attention` phase on a CPU, where each benchmark exits 2), and collect.py shows a failed command's log from it."""
    import os
    import tarfile

    out = tmp_path / "out"
    env = {**os.environ, "OUT": str(out), "PY": sys.executable}
    proc = subprocess.run(["bash", str(SESSION), "attention"], capture_output=True, text=True, cwd=ROOT, env=env,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    files = [p for p in out.rglob("*") if p.is_file()]
    assert sorted(p.relative_to(out).as_posix() for p in files) == ["logs.tar.gz", "status.txt"]
    with tarfile.open(out / "logs.tar.gz") as tar:
        assert {"logs/attention.log", "logs/decode_attention.log", "logs/setup.log"} <= set(tar.getnames())
    mod = load_script("gpu/collect.py", monkeypatch)
    monkeypatch.setattr(mod, "RESULTS", tmp_path / "dest")
    (tmp_path / "dest").mkdir()
    import torch

    if not torch.cuda.is_available():  # every benchmark exited 2: named, with its log's last lines from the archive
        assert mod.main([str(out)]) == 1
        printed = capsys.readouterr().out
        assert "FAILED: attention rc=2" in printed and "bench/attention.py needs a CUDA device" in printed


def test_each_readme_call_fits_one_device_call():
    """A call's command limits (plus `timeout --kill-after=10` each) leave a minute of the device tool's 600 s for
    set-up and packing: a call it kills brings back neither the summary nor the packed logs."""
    root = Path(__file__).resolve().parents[2]
    script = (root / "bench" / "gpu" / "session.sh").read_text()
    bodies = dict(re.findall(r"^phase_(\w+)\(\) \{.*?\n(.*?)^\}", script, re.S | re.M))
    calls = re.findall(r"`bash bench/gpu/session.sh ([a-z ]+)`", (root / "bench" / "gpu" / "README.md").read_text())
    assert len(calls) == 7
    for call in calls:
        limits = [int(n) for phase in call.split() for n in re.findall(r"^\s*run \S+ (\d+) ", bodies[phase], re.M)]
        assert limits, call
        assert sum(limits) + 10 * len(limits) <= 560, f"{call}: limits {limits}"


def test_collect_warns_when_a_result_was_measured_at_another_commit(tmp_path, monkeypatch, capsys):
    """.gpu/deps/COMMIT goes stale when one commits after wheels.sh: collect.py says so (a warning, not a failure)."""
    import json

    mod = load_script("gpu/collect.py", monkeypatch)
    monkeypatch.setattr(mod, "RESULTS", tmp_path / "dest")
    monkeypatch.setattr(mod, "local_head", lambda: "a" * 40)
    (tmp_path / "dest").mkdir()
    src = tmp_path / "at"
    (src / "results").mkdir(parents=True)
    (src / "results" / "quant-x.json").write_text(json.dumps({"commit": "a" * 40 + "-dirty", "status": "complete"}))
    assert mod.main([str(src)]) == 0
    assert "WARNING" not in capsys.readouterr().out
    (src / "results" / "quant-x.json").write_text(json.dumps({"commit": "b" * 40, "status": "complete"}))
    assert mod.main([str(src)]) == 0
    out = capsys.readouterr().out
    assert f"WARNING quant-x.json: measured at commit {'b' * 40}, but HEAD here is {'a' * 40}" in out
