"""--speculation on the commands that build an engine (run, serve, bench throughput), and LLM(speculation=...): the
flag's text is checked as it is parsed (errors point into it), `off` overrides the spec's key, and the drafter is
prepared before the target is compiled. Runs that need the speculative runtime skip until it is merged."""

from __future__ import annotations

import argparse
import json
import re
from pathlib import Path

import pytest

from kiln.build import load_model
from kiln.cli.commands import build_parser, main
from kiln.cli.common import serving_engine, step_model
from kiln.model_config import SpeculationConfig
from kiln.spec.loader import load_spec

S = SpeculationConfig


def spec_with(tmp_path: Path, line: str) -> Path:
    text = Path(load_spec("tiny-llama").path).read_text().replace("  dtype = fp32\n", f"  dtype = fp32\n  {line}\n")
    path = tmp_path / "s.kiln"
    path.write_text(text)
    return path


@pytest.mark.parametrize("command", [["run", "--prompt", "x"], ["serve"], ["bench", "throughput"]],
                         ids=lambda c: " ".join(c[:2]))
def test_the_flag_is_parsed_in_the_spec_syntax(command):
    parse = build_parser().parse_args
    assert parse([*command, "--speculation", "self(layers = 1, k = 2)"]).speculation == S("self", k=2, layers=1)
    assert parse([*command, "--speculation", "ngram(n=2,k=5)"]).speculation == S("ngram", k=5, n=2)
    assert parse([*command, "--speculation", 'draft(spec = "d.kiln")']).speculation == S("draft", spec="d.kiln")
    assert parse([*command, "--speculation", "off"]).speculation == "off"
    assert parse(command).speculation is None


def test_a_bad_flag_is_refused_before_any_work_with_its_position(capsys):
    with pytest.raises(SystemExit) as info:
        main(["run", "--prompt", "x", "--speculation", "ngram(n = 3, k = 40)"])
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert "--speculation:1:18: error: k = 40 is above the largest kiln can build, 16" in err
    assert "    ngram(n = 3, k = 40)\n" + " " * 21 + "^" in err
    with pytest.raises(SystemExit):
        main(["serve", "--speculation", "tree(k = 2)"])
    assert "--speculation:1:1: error: unknown speculation `tree`" in capsys.readouterr().err


def _args(**kw) -> argparse.Namespace:
    base = {"kv_cache_dtype": None, "num_blocks": 64, "block_size": None, "gpu_memory_utilization": 0.9,
            "speculation": None, "seed": 0}
    return argparse.Namespace(**base | kw)


def test_step_model_prepares_the_drafter_from_the_flag_or_the_spec(tmp_path):
    path = spec_with(tmp_path, "speculation = self(layers = 1, k = 3)")
    args = _args()
    step = step_model(args, load_model(path, device="cpu"))
    assert args.draft_plan.config == S("self", k=3, layers=1) and step.num_layers == 2
    args = _args(speculation=S("ngram", k=2, n=2))  # the flag wins over the spec's key
    step_model(args, load_model(path, device="cpu"))
    assert args.draft_plan.config == S("ngram", k=2, n=2)
    args = _args(speculation="off")
    step_model(args, load_model(path, device="cpu"))
    assert args.draft_plan is None
    args = _args()  # no flag, no key: the engine is built as without speculation
    m = load_model("tiny-llama", device="cpu")
    engine = serving_engine(args, m, max_num_seqs=2)
    assert args.draft_plan is None and engine.block_manager.num_usable_blocks == 63


def test_a_self_drafter_too_deep_for_the_model_is_a_clean_error(capsys):
    code = main(["run", "--prompt-ids", "1,2", "--speculation", "self(layers = 2)"])
    err = capsys.readouterr().err
    assert code == 2
    assert "kiln: error: --speculation self(layers = 2, k = 4): the self drafter must use fewer layers than the 2 " \
           "of model 'tiny-llama'" in err


@pytest.mark.parametrize("drafter", ["ngram(n = 2, k = 3)", "self(layers = 1, k = 2)", 'draft(spec = "tiny-llama")'])
def test_run_with_speculation_is_greedy_identical(capsys, drafter):
    argv = ["run", "tiny-llama", "--prompt-ids", "1,2,3,1,2,3,1,2", "--max-tokens", "12", "--temperature", "0",
            "--json"]
    assert main(argv) == 0
    plain = json.loads(capsys.readouterr().out)["token_ids"]
    assert main([*argv, "--speculation", drafter]) == 0
    out = capsys.readouterr()
    assert json.loads(out.out)["token_ids"] == plain
    if drafter.startswith("draft"):  # the target as its own drafter: every draft is accepted, and the run says so
        assert re.search(r"speculation: (\d+) of \1 draft tokens accepted \(100%\)", out.err), out.err


def test_llm_speculation_argument(tmp_path):
    from kiln.errors import SpecError
    from kiln.llm import LLM
    from kiln.runtime.sampling_params import SamplingParams

    path = spec_with(tmp_path, "speculation = ngram(n = 2, k = 3)")
    llm = LLM(path, device="cpu", speculation="off", num_blocks=32)  # off wins over the spec's key
    assert llm.speculation is None
    out = llm.generate(prompt_token_ids=[1, 2, 3], sampling_params=SamplingParams(temperature=0, max_tokens=4))
    assert len(out[0].outputs[0].token_ids) == 4
    with pytest.raises(SpecError, match=r"speculation:1:11: error: n must be a positive integer, got 0"):
        LLM(path, device="cpu", speculation={"kind": "ngram", "n": 0})


@pytest.mark.parametrize("speculation", [S("ngram", k=3, n=2), "self(layers = 1, k = 2)", {"kind": "ngram", "k": 2},
                                         None], ids=["config", "text", "dict", "spec key"])
def test_llm_with_speculation_is_greedy_identical(tmp_path, speculation):
    from kiln.llm import LLM
    from kiln.runtime.sampling_params import SamplingParams

    path = spec_with(tmp_path, "speculation = self(layers = 1, k = 3)")
    params = SamplingParams(temperature=0, max_tokens=10)
    prompts = [[1, 2, 3, 1, 2, 3], [5, 6, 7, 8]]
    plain = LLM(path, device="cpu", speculation="off").generate(prompt_token_ids=prompts, sampling_params=params)
    llm = LLM(path, device="cpu", speculation=speculation)
    assert llm.speculation is not None
    fast = llm.generate(prompt_token_ids=prompts, sampling_params=params)
    assert [o.outputs[0].token_ids for o in fast] == [o.outputs[0].token_ids for o in plain]


def test_bench_throughput_records_the_drafter_and_its_acceptance(capsys):
    argv = ["bench", "throughput", "tiny-llama", "--num-requests", "3", "--input-len", "8", "--output-len", "6",
            "--json", "--num-blocks", "32"]
    assert main(argv) == 0
    plain = json.loads(capsys.readouterr().out)
    assert plain["config"]["speculation"] == "off" and "speculation" not in plain["continuous"]
    assert main([*argv, "--speculation", "ngram(n = 2, k = 3)"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert result["config"]["speculation"] == "ngram(n = 2, k = 3)"
    spec = result["continuous"]["speculation"]
    assert spec["proposed"] >= spec["accepted"] >= 0 and spec["verify_steps"] > 0


def test_bench_throughput_records_the_quantize_scheme(capsys):
    argv = ["bench", "throughput", "tiny-llama", "--num-requests", "2", "--input-len", "4", "--output-len", "2",
            "--json", "--num-blocks", "32", "--device", "cpu"]
    assert main(argv) == 0
    assert json.loads(capsys.readouterr().out)["config"]["quantize"] is None
    assert main([*argv, "--quantize", "int8"]) == 0
    assert json.loads(capsys.readouterr().out)["config"]["quantize"] == "int8"
