"""bench/torch_backend.py's failure handling in --smoke mode (--save-smoke writes the JSON the GPU run writes): a
variant that raises is recorded and the next one still runs, the JSON is on disk before --explain runs, and any
error makes the exit code 1."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def bench(monkeypatch):
    monkeypatch.syspath_prepend(str(ROOT / "bench"))  # for bench_meta, as when run as a script
    monkeypatch.setenv("KILN_DEBUG", "0")
    spec = importlib.util.spec_from_file_location("torch_backend_bench", ROOT / "bench" / "torch_backend.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    yield mod
    torch._dynamo.reset()


def test_a_failing_variant_and_explain_are_recorded_and_the_rest_is_saved(bench, monkeypatch, tmp_path, capsys):
    real = bench.compiled_forward

    def kiln_breaks(model, variant, options):
        if variant == "kiln":
            raise RuntimeError("kiln backend failed to compile")
        return real(model, variant, options)

    seen_before_explain = []

    def explain_breaks(*args, **kwargs):
        [path] = tmp_path.glob("torch_backend-*.json")
        seen_before_explain.append(json.loads(path.read_text()))
        raise MemoryError("explain ran out of memory")

    monkeypatch.setattr(bench, "compiled_forward", kiln_breaks)
    monkeypatch.setattr(bench, "explain_text", explain_breaks)
    argv = ["--smoke", "--save-smoke", "--variants", "kiln,eager", "--explain", "--out-dir", str(tmp_path)]
    assert bench.main(argv) == 1
    [early] = seen_before_explain
    assert early["errors"] == {"kiln": "RuntimeError: kiln backend failed to compile"}
    assert early["results"]["eager"]["prefill"]["median_ms"] > 0  # the variant after the failing one ran
    assert early["explain_prefill"] == "not yet run"
    [path] = tmp_path.glob("torch_backend-*.json")
    final = json.loads(path.read_text())
    assert final["errors"] == {"kiln": "RuntimeError: kiln backend failed to compile",
                               "explain": "MemoryError: explain ran out of memory"}
    assert set(final["results"]["eager"]) == {"prefill", "decode"} and final["results"]["kiln"] == {}
    assert "explain_prefill" not in final
    err = capsys.readouterr().err
    assert "ERROR kiln: RuntimeError" in err and "ERROR explain: MemoryError" in err
