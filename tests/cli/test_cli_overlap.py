"""--overlap-outputs / --no-overlap-outputs and --async-scheduling / --no-async-scheduling on the commands that build
an engine (run, serve, bench throughput): one definition in the shared engine flags, and the values reach
Engine(overlap_outputs=..., async_scheduling=...)."""

from __future__ import annotations

import json

import pytest

import kiln.runtime.engine as engine_mod
from kiln.build import load_model
from kiln.cli.commands import build_parser, main
from kiln.cli.common import serving_engine

COMMANDS = [["run", "--prompt", "x"], ["serve"], ["bench", "throughput"]]


@pytest.mark.parametrize("command", COMMANDS, ids=lambda c: " ".join(c[:2]))
def test_the_flag_is_parsed_on_every_engine_command(command):
    parse = build_parser().parse_args
    assert parse([*command, "--overlap-outputs"]).overlap_outputs is True
    assert parse([*command, "--no-overlap-outputs"]).overlap_outputs is False
    assert parse(command).overlap_outputs is None  # auto: the engine decides (on for CUDA)
    assert parse([*command, "--async-scheduling"]).async_scheduling is True
    assert parse([*command, "--no-async-scheduling"]).async_scheduling is False
    assert parse(command).async_scheduling is None


@pytest.mark.parametrize("command", COMMANDS, ids=lambda c: " ".join(c[:2]))
def test_the_parsed_flag_reaches_the_engine(command):
    m = load_model("tiny-llama", device="cpu")
    parse = build_parser().parse_args
    for flag, want in (("--overlap-outputs", True), ("--no-overlap-outputs", False), (None, False)):
        args = parse([*command, "--num-blocks", "40", *([flag] if flag else [])])
        engine = serving_engine(args, m, max_num_seqs=2)
        assert engine.overlap_outputs is want, (flag, engine.overlap_outputs)  # None on CPU: off
        assert engine.async_scheduling is False
    args = parse([*command, "--num-blocks", "40", "--async-scheduling"])
    engine = serving_engine(args, m, max_num_seqs=2)
    assert engine.async_scheduling is True and engine.overlap_outputs is True  # it implies the overlap


def test_kiln_run_with_the_overlap_gives_the_same_tokens(monkeypatch, capsys):
    built: list[engine_mod.Engine] = []

    class Recorded(engine_mod.Engine):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            built.append(self)

    monkeypatch.setattr(engine_mod, "Engine", Recorded)  # serving_engine imports it when called
    argv = ["run", "tiny-llama", "--prompt-ids", "1,2,3", "--max-tokens", "6", "--temperature", "0", "--json"]
    outs = {}
    for flag in ("--no-overlap-outputs", "--overlap-outputs", "--async-scheduling"):
        assert main([*argv, flag]) == 0
        outs[flag] = json.loads(capsys.readouterr().out)
    assert [e.overlap_outputs for e in built] == [False, True, True]
    assert [e.async_scheduling for e in built] == [False, False, True]
    assert outs["--overlap-outputs"]["token_ids"] == outs["--no-overlap-outputs"]["token_ids"]
    assert outs["--async-scheduling"]["token_ids"] == outs["--no-overlap-outputs"]["token_ids"]
    assert len(outs["--overlap-outputs"]["token_ids"]) == 6
    assert built[1].num_steps >= 6 and not built[1].has_unfinished()
    assert built[2].stats.num_steps_ahead > 0 and not built[2].has_unfinished()
