"""A draft model (speculation = draft(...)) checked before it loads: a shorter context than the target's is a note (at
`kiln check` and at load) saying past how many tokens speculation stops, and the drafter built for it stops there;
a bad `weights` is named as the speculation's key, as written and as resolved, never as a --weights flag."""

from __future__ import annotations

import dataclasses
import logging
import re
from pathlib import Path

import pytest

from kiln.build import load_model
from kiln.cli.commands import main
from kiln.compile.step import compile_step
from kiln.errors import KilnError
from kiln.model_config import SpeculationConfig
from kiln.spec.loader import load_spec
from kiln.spec.speculation import parse_speculation
from kiln.speculation import (
    build_drafter,
    check_draft,
    draft_context_note,
    prepare_drafter,
    resolve_speculation,
)

S = SpeculationConfig


def gpt2_spec(path: Path, *, name: str, context: int = 256, compile_line: str = "") -> Path:
    """tiny-gpt2 (learned positions) as `name`, with its context and a compile setting."""
    text = Path(load_spec("tiny-gpt2").path).read_text().replace('"tiny-gpt2"', f'"{name}"')
    text = text.replace("context = 256", f"context = {context}")
    if compile_line:
        text = text.replace("  dtype = fp32\n", f"  dtype = fp32\n  {compile_line}\n")
    path.write_text(text)
    return path


@pytest.fixture
def pair(tmp_path):
    """A target spec (context 256) whose speculation key drafts with a context-64 model beside it."""
    gpt2_spec(tmp_path / "draft64.kiln", name="draft64", context=64)
    return gpt2_spec(tmp_path / "t.kiln", name="t", compile_line='speculation = draft(spec = "draft64.kiln", k = 4)')


def test_check_notes_a_draft_with_a_shorter_context_and_passes(pair, capsys):
    assert main(["check", str(pair)]) == 0
    out, err = capsys.readouterr()
    assert f"{pair}: ok (t," in out
    assert (f"{pair}: note: the draft model 'draft64' takes 64 tokens of context, the target 't' 256: speculation "
            "stops once a request passes 61 tokens (the positions of its k = 4 drafts must fit the draft's context); "
            "longer requests decode without drafts") in err


def test_check_says_nothing_of_a_draft_as_long_as_the_target(tmp_path, capsys):
    gpt2_spec(tmp_path / "d.kiln", name="d", context=512)
    target = gpt2_spec(tmp_path / "t.kiln", name="t", compile_line='speculation = draft(spec = "d.kiln", k = 4)')
    assert main(["check", str(target)]) == 0
    assert "note" not in capsys.readouterr().err


def test_the_note_when_k_leaves_no_room():
    target = load_spec("tiny-gpt2").model
    draft = dataclasses.replace(target, context=8)
    note = draft_context_note(S("draft", k=9, spec="x"), draft, target)
    assert note is not None and "k = 9 drafts leave no room in it, so nothing is speculated" in note
    assert "passes 1 tokens" in draft_context_note(S("draft", k=8, spec="x"), draft, target)  # positions 0..7
    assert draft_context_note(S("draft", k=4, spec="x"), target, target) is None


def test_load_says_the_note_and_the_drafter_stops_at_the_draft_context(pair, caplog):
    m = load_model(pair, device="cpu")
    with caplog.at_level(logging.INFO, logger="kiln"):
        plan = prepare_drafter(resolve_speculation(None, m), m)
    assert any("note: the draft model 'draft64' takes 64 tokens of context" in r.getMessage() for r in caplog.records)
    target = compile_step(m.gm, m.model, m.compile, device="cpu", use_kernels=False)
    assert build_drafter(plan, target).context == 64


def test_the_self_drafter_has_no_bound_of_its_own():
    m = load_model("tiny-gpt2", device="cpu")
    plan = prepare_drafter(S("self", layers=1, k=2), m)
    target = compile_step(m.gm, m.model, m.compile, device="cpu", use_kernels=False)
    assert build_drafter(plan, target).context is None


# ---- the draft's weights named as the speculation's key


def _no_flag(text: str) -> str:
    assert "--weights" not in text, text
    return text


def test_a_flags_weights_are_named_as_written_and_resolved_from_the_working_directory(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    target = load_spec("tiny-llama").model
    with pytest.raises(KilnError) as info:
        check_draft(parse_speculation('draft(weights = "nowhere/")'), target)
    msg = _no_flag(str(info.value))
    assert msg.startswith('speculation draft(weights = "nowhere/", k = 4): cannot load the draft model: ')
    assert f'weights = "nowhere/" (resolved from the working directory: {tmp_path / "nowhere"}): does not exist' in msg
    (tmp_path / "f.bin").write_text("x")
    with pytest.raises(KilnError) as info:
        check_draft(parse_speculation(f'draft(weights = "{tmp_path / "f.bin"}")'), target)
    assert f'weights = "{tmp_path / "f.bin"}": is a file, not a checkpoint directory' in _no_flag(str(info.value))



def test_a_checkpoint_dir_given_as_the_drafts_spec_is_named_as_its_spec(tmp_path, monkeypatch):
    """draft(spec = DIR) takes DIR as the draft's checkpoint: a directory without config.json is the key's fault."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "ckpt").mkdir()
    with pytest.raises(KilnError) as info:
        check_draft(parse_speculation('draft(spec = "ckpt")'), load_spec("tiny-llama").model)
    msg = _no_flag(str(info.value))
    assert f'spec = "ckpt" (resolved from the working directory: {tmp_path / "ckpt"}): no config.json there' in msg


def test_a_spec_file_as_weights_is_pointed_at_spec(tmp_path):
    draft = gpt2_spec(tmp_path / "d.kiln", name="d")
    with pytest.raises(KilnError, match=re.escape("is a spec file, not weights; name it as the draft's spec: "
                                                  'draft(spec = "...", k = ...)')) as info:
        check_draft(S("draft", weights=str(draft)), load_spec("tiny-gpt2").model)
    _no_flag(str(info.value))


def test_a_spec_keys_weights_are_named_as_written_and_resolved_from_its_folder(tmp_path, capsys):
    spec = gpt2_spec(tmp_path / "t.kiln", name="t", compile_line='speculation = draft(weights = "nowhere/", k = 3)')
    resolved = tmp_path / "nowhere"
    assert main(["check", str(spec)]) == 2
    err = _no_flag(capsys.readouterr().err)
    assert f'weights = "nowhere" (resolved from the spec\'s folder: {resolved}): does not exist' in err
    assert '    speculation = draft(weights = "nowhere/", k = 3)' in err  # the line as written, under the error
    m = load_model(spec, device="cpu")  # kiln run / LLM: the same words, with the spec named
    with pytest.raises(KilnError) as info:
        prepare_drafter(resolve_speculation(None, m), m)
    msg = _no_flag(str(info.value))
    assert msg.startswith(f'speculation draft(weights = "nowhere", k = 3) in {spec}: cannot load the draft model: ')
    assert f'weights = "nowhere" (resolved from the spec\'s folder: {resolved}): does not exist' in msg
