"""CLI defects a tester found: the throughput bench's warm-up, --seed's range, what --weights names instead of a
checkpoint, and `kiln check`'s size of a quantized spec."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kiln.cli.commands import main
from kiln.quant.formats import parse_scheme
from kiln.quant.sizing import quantized_bytes
from kiln.runtime import throughput
from kiln.spec.limits import format_bytes
from kiln.spec.loader import load_spec

SPECS = Path(__file__).resolve().parents[2] / "specs"


def test_bench_throughput_warms_up_untimed_before_the_timed_runs(capsys, monkeypatch):
    calls = []
    real_warm, real_run = throughput.warm_up, throughput.run_trace

    def warm(engine, **kw):
        calls.append(("warm_up", engine))
        return real_warm(engine, **kw)

    def run(engine, trace, **kw):
        calls.append(("run_trace", engine))
        return real_run(engine, trace, **kw)

    monkeypatch.setattr(throughput, "warm_up", warm)
    monkeypatch.setattr(throughput, "run_trace", run)
    code = main(["bench", "throughput", "tiny-llama", "--num-requests", "3", "--input-len", "4:8",
                 "--output-len", "2:3", "--device", "cpu", "--json"])
    out, err = capsys.readouterr()
    assert code == 0 and [c[0] for c in calls] == ["warm_up", "run_trace", "run_trace"]
    assert len({id(c[1]) for c in calls}) == 3  # its own engine: no counters or cached prefixes carry over
    r = json.loads(out)
    assert r["warmup"]["requests"] >= 1 and r["warmup"]["output_len"] >= 1 and r["warmup"]["elapsed_s"] > 0
    assert r["continuous"]["steps"] > 0 and "warm-up" in err


def test_warm_up_runs_its_batch_to_completion():
    from kiln.runtime.engine import Engine
    from tests.support.fake_step import FakeStepModel, fake_config

    e = Engine(FakeStepModel(97), None, fake_config(16), block_size=4)
    w = throughput.warm_up(e, vocab=97, context=16)
    assert not e.has_unfinished() and w["prompt_len"] + w["output_len"] <= 16 and e.stats.num_steps > 0


@pytest.mark.parametrize("seed", ["9223372036854775808", "18446744073709551615"])  # 2**63 .. 2**64 - 1
def test_seed_takes_the_sampling_params_range(capsys, seed):
    code = main(["run", "--prompt-ids", "1,2,3", "--max-tokens", "3", "--seed", seed, "--device", "cpu", "--json"])
    out, _ = capsys.readouterr()
    assert code == 0 and len(json.loads(out)["token_ids"]) == 3


def test_seed_above_the_range_names_it(capsys):
    with pytest.raises(SystemExit):
        main(["run", "--prompt", "x", "--seed", str(2**64)])
    assert "from 0 to 2**64 - 1" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("weights", "needle"),
    [
        ("{tmp}/nonexistent", "does not exist"),
        (str(SPECS / "tiny-llama.kiln"), "is a spec file, not weights; pass it as the spec (SPEC"),
        ("{tmp}/notes.txt", "is a file, not a checkpoint directory"),
        ("{tmp}", "no config.json there"),
    ],
)
def test_weights_that_are_not_a_checkpoint_say_what_they_are(capsys, tmp_path, weights, needle):
    (tmp_path / "notes.txt").write_text("hi")
    code = main(["run", "--weights", weights.format(tmp=tmp_path), "--prompt", "x"])
    err = capsys.readouterr().err
    assert code == 2 and needle in err and "Traceback" not in err
    if needle != "no config.json there":
        assert "no config.json" not in err


def test_import_of_a_missing_dir_or_a_spec_says_so(capsys, tmp_path):
    assert main(["import", str(tmp_path / "nope")]) == 2
    assert "does not exist" in capsys.readouterr().err
    assert main(["import", str(SPECS / "tiny-llama.kiln")]) == 2
    assert "is a spec file, not a checkpoint" in capsys.readouterr().err


def test_check_reports_a_quantized_spec_at_its_quantized_size(capsys, tmp_path):
    src = (SPECS / "tiny-llama.kiln").read_text()
    path = tmp_path / "q.kiln"
    path.write_text(src.replace("dtype = fp32", "dtype = fp32\n  quantize = int4"))
    assert main(["check", str(path), str(SPECS / "tiny-llama.kiln")]) == 0
    out = capsys.readouterr().out.splitlines()
    # the bytes the quantize pass leaves (group 64: 128 does not divide K = 64), not the fp32 size (545.2 KiB)
    # (tests/quant/test_group_fit.py checks quantized_bytes against the quantize pass's graphs)
    expected = format_bytes(quantized_bytes(load_spec("tiny-llama").model, 4, parse_scheme("int4-g64")))
    assert out[0].split("parameters, ")[1].startswith(f"{expected} of weights quantized to int4-rtn-g64, the rest "
                                                      "in fp32 (545.2 KiB unquantized)")
    assert "545.2 KiB of weights in fp32)" in out[1]
