"""bench/quant.py: its CPU smoke mode (every kernel path checked against the reference, the tiny step's launch
profile, no figures) and the shapes it times, so a GPU session does not discover a typo."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.support.bench_scripts import load_script

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def bench(monkeypatch):
    mod = load_script("quant.py", monkeypatch)
    return mod


def test_smoke_checks_every_path_and_writes_no_figure(bench, tmp_path, capsys):
    assert bench.main(["--smoke", "--out-dir", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "--smoke: ok (no figures)" in out
    assert "tiny-llama int4-g128 step:" in out and "not fused:" in out
    assert not list(tmp_path.iterdir())


def test_shapes_are_the_fused_linears_of_the_specs(bench):
    assert bench.linear_shapes("llama-3.2-1b") == [("qkv", 3072, 2048), ("o", 2048, 2048), ("gate_up", 16384, 2048),
                                                   ("down", 2048, 8192), ("lm_head", 128256, 2048)]  # fmt: skip
    assert bench.linear_shapes("llama-3.1-8b")[3] == ("down", 4096, 14336)


def test_launch_profile_counts_the_split_k_reduce_as_a_launch(bench, monkeypatch):
    from quant_linear import Linear
    from quant_step import launch_profile
    from torch import fx

    import kiln.codegen.quant as quant
    from kiln.compile.lowering import lower

    lin = Linear(24, 1536, "int4-g128", "cpu", torch.float32)
    qweight, scales, _, group = lin.parts[0]

    class M(torch.nn.Module):
        def forward(self, x):
            return torch.ops.kiln.linear_w4.default(x, self.q, self.s, None, group, None)

    m = M()
    m.register_buffer("q", qweight)
    m.register_buffer("s", scales)
    gm = lower(fx.symbolic_trace(m))
    x = torch.randn(1, 1536)
    assert launch_profile(gm, [x])["launches_per_step"] == 1  # one SM: no split
    monkeypatch.setattr(quant, "device_info", lambda device: (64, (9, 0)))  # many SMs, 6 tiles: split-K + reduce
    profile = launch_profile(gm, [x])
    assert profile["launches_per_step"] == 2
    assert profile["ops"] == [{"op": "linear_w4", "nodes": 1, "launches": 2, "runs_as": "kiln:quant_gemv+quant_reduce"}]


def test_per_shape_rows_and_sweep_winners_on_cpu(bench, monkeypatch):
    # The CUDA-graph timing is the one part a CPU cannot run: a stand-in gives each call list a time; everything
    # else (weights, copies, the checks against the reference, rows, winners, the JSON) runs as on the GPU.
    import ast
    import json

    import quant_linear

    monkeypatch.setattr(quant_linear, "time_calls", lambda fns: 1e-5)
    shapes = [("test", "odd", 40, 256)]
    rows = bench.measure_shapes(shapes, [1, 17], ceiling=100.0, device="cpu", dtype=torch.float32)
    assert [(r["scheme"], r["m"]) for r in rows] == [(s, m) for s in bench.SCHEMES for m in (1, 17)]
    assert all(r["max_rel_err"] < 1e-4 and r["bytes"] > 0 for r in rows)
    int4 = [r for r in rows if r["scheme"] == "int4-g128"]
    assert [r["tile"]["kernel"] for r in int4] == ["quant_gemv", "quant_gemm"]
    assert int4[0]["bytes"] == 40 * 128 + 40 * 2 * 4 + 4 * (256 + 40)  # codes, fp32 scales, fp32 x and out
    monkeypatch.setitem(bench.SWEEP, "gemv", [(4, 128, 1, 4), (8, 256, 2, 4)])
    monkeypatch.setitem(bench.SWEEP, "gemm", [(16, 64, 1), (32, 128, 2)])
    winners = bench.sweep(shapes, ceiling=100.0, device="cpu", dtype=torch.float32)
    keys = [ast.literal_eval(w["key"]) for w in winners]  # pasted into codegen/quant_tiles.py MEASURED as is
    assert [k[1:5] for k in keys] == [("quant_gemv", 8, 0, 1), ("quant_gemm", 8, 0, 16), ("quant_gemv", 4, 128, 1),
                                      ("quant_gemm", 4, 128, 16)]  # fmt: skip
    assert all(w["candidates"] == 2 for w in winners)
    json.dumps({"shapes": rows, "sweep": winners})


def test_a_failing_scheme_is_its_rows_error_and_every_row_is_handed_on(bench, monkeypatch):
    """A (shape, scheme) that raises is recorded as one row with its error and the next still runs; on_row gets the
    rows after each one, so the GPU run writes its file as it goes (a time limit keeps what was measured)."""
    import quant_linear

    monkeypatch.setattr(quant_linear, "time_calls", lambda fns: 1e-5)
    real_check = quant_linear.Linear.check

    def check(self, x, *a, **k):
        if self.scheme == "int8":
            raise RuntimeError("illegal memory access")
        return real_check(self, x, *a, **k)

    monkeypatch.setattr(quant_linear.Linear, "check", check)
    seen = []
    rows = bench.measure_shapes([("test", "odd", 40, 256)], [1, 17], ceiling=100.0, device="cpu",
                                dtype=torch.float32, on_row=lambda r: seen.append(len(r)))
    assert [(r["scheme"], r.get("m"), r.get("error")) for r in rows] == [
        ("bf16", 1, None), ("bf16", 17, None), ("int8", None, "RuntimeError: illegal memory access"),
        ("int4-g128", 1, None), ("int4-g128", 17, None)]
    assert seen == [1, 2, 3, 4, 5]
