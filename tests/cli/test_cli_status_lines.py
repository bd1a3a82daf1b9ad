"""Status lines (kiln.progress.say, the byte-level tokenizer's warning, the router fit's progress) go through the
`kiln` loggers: the CLI prints them on stderr as `kiln: ...`, as it did when they were prints; from Python (LLM)
they are log records that follow the program's logging setup, and a status line is printed by kiln itself only while
the program has set up no logging at all."""

from __future__ import annotations

import logging

import pytest

import kiln.tokenizer as tokmod
from kiln.cli.commands import main
from kiln.ir.frontend import random_weights
from kiln.progress import say
from kiln.tokenizer import load_tokenizer
from kiln.train.routers import RouterTraining, distil
from tests.support.train_data import DENSE, IDS

KILN_LOGGERS = ("kiln", "kiln.status")
FALLBACK = "no tokenizer.json (no checkpoint); using a byte-level tokenizer (ids 0-255)"


@pytest.fixture
def kiln_logging():
    """The kiln loggers' handlers and levels put back as they were after the test (main() sets them)."""
    loggers = [logging.getLogger(n) for n in KILN_LOGGERS]
    saved = [(lg.handlers[:], lg.level) for lg in loggers]
    yield loggers
    for lg, (handlers, level) in zip(loggers, saved, strict=True):
        lg.handlers[:] = handlers
        lg.setLevel(level)


@pytest.fixture
def python_logging(kiln_logging):
    """The kiln loggers as a Python program finds them (no handler, no level), whatever a CLI test set before."""
    for lg in kiln_logging:
        lg.handlers.clear()
        lg.setLevel(logging.NOTSET)


def _records(caplog) -> list[tuple[str, str, str]]:
    return [(r.name, r.levelname, r.getMessage()) for r in caplog.records]


def test_say_is_an_info_record_that_follows_the_programs_level(python_logging, caplog, capsys):
    caplog.set_level(logging.INFO)  # a program that asks for INFO gets the line through its own handlers
    say("loaded x")
    assert _records(caplog) == [("kiln.status", "INFO", "loaded x")]
    caplog.clear()
    caplog.set_level(logging.WARNING)  # and one that asks for warnings only does not
    say("loaded y")
    assert _records(caplog) == []
    assert capsys.readouterr().err == ""  # kiln prints nothing itself: the program has set up logging


def test_say_prints_as_the_cli_does_while_no_logging_is_set_up(python_logging, capsys):
    root = logging.getLogger()
    saved = root.handlers[:]
    root.handlers.clear()  # pytest's capture handlers: a program that has set up no logging has none
    try:
        say("loaded x")
        assert capsys.readouterr().err == "kiln: loaded x\n"  # LLM(...) shows its notes, as `kiln run` and vLLM do
        logging.getLogger("kiln").setLevel(logging.WARNING)  # a level alone hides them
        say("loaded y")
        assert capsys.readouterr().err == ""
    finally:
        root.handlers[:] = saved


def test_the_byte_level_fallback_is_a_warning_given_once(python_logging, caplog, capsys, monkeypatch, tmp_path):
    monkeypatch.setattr(tokmod, "_noted", False)
    caplog.set_level(logging.WARNING)
    load_tokenizer(tmp_path, vocab=300)
    load_tokenizer(None, vocab=300)
    assert _records(caplog) == [("kiln.tokenizer", "WARNING",
                                 f"no tokenizer.json in {tmp_path}; using a byte-level tokenizer (ids 0-255)")]
    assert capsys.readouterr().err == ""


def test_router_fit_progress_is_a_status_record(python_logging, caplog, capsys):
    caplog.set_level(logging.INFO)
    distil(DENSE, random_weights(DENSE), IDS, RouterTraining(capacity=0.5, steps=0, seq_len=48, calib_windows=4),
           progress=True)
    fitted = [m for name, level, m in _records(caplog) if name == "kiln.status" and level == "INFO"]
    assert [m.split(" (")[0] for m in fitted] == ["router of layer 1 fitted", "router of layer 3 fitted"]
    assert "router of layer" not in capsys.readouterr().err


def test_the_cli_prints_status_lines_as_before_and_other_info_only_with_debug(kiln_logging, capsys, monkeypatch):
    monkeypatch.setattr(tokmod, "_noted", False)
    other = logging.getLogger("kiln.cache")  # an INFO record of another kiln logger (as main left the loggers set)
    assert main(["run", "--prompt", "ab", "--max-tokens", "2", "--temperature", "0"]) == 0
    other.info("removed 3 stale temporary files")
    lines = capsys.readouterr().err.splitlines()
    assert f"kiln: {FALLBACK}" in lines  # a warning, printed as the note it was
    assert any(line.startswith("kiln: loaded tiny-llama from ") for line in lines)  # a status line (say)
    assert "kiln: removed 3 stale temporary files" not in lines  # kiln's other INFO records wait for --debug

    assert main(["run", "--prompt", "ab", "--max-tokens", "2", "--temperature", "0", "--debug"]) == 0
    other.info("removed 3 stale temporary files")
    lines = capsys.readouterr().err.splitlines()
    assert any(line.startswith("kiln: loaded tiny-llama from ") for line in lines)
    assert "kiln: removed 3 stale temporary files" in lines


def test_router_fit_progress_prints_while_no_logging_is_set_up(python_logging, capsys):
    """A script calling distil(progress=True) sees a line per fitted router, as kiln.progress.say prints them."""
    root = logging.getLogger()
    saved = root.handlers[:]
    root.handlers.clear()
    try:
        distil(DENSE, random_weights(DENSE), IDS, RouterTraining(capacity=0.5, steps=0, seq_len=48, calib_windows=4),
               progress=True)  # fmt: skip
    finally:
        root.handlers[:] = saved
    fitted = [line for line in capsys.readouterr().err.splitlines() if "fitted" in line]
    assert [line.split(" (")[0] for line in fitted] == [f"kiln: router of layer {i} fitted" for i in (1, 3)]
