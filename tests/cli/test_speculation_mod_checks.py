"""Drafters that cannot serve a model are refused before anything heavy loads, naming the setting at fault: any
speculation on a Mixture-of-Depths target, a routed draft model, a draft of another vocabulary (read from its spec,
before its weights), a draft path that does not exist; `kiln check` finds the same. Also the MoD CLI's small
checks: `route` in the compile block, --hidden without a predictor, and what `kiln run` says of a routed model."""

from __future__ import annotations

from pathlib import Path

import pytest

import kiln.speculation as speculation
from kiln.build import load_model
from kiln.cli.commands import main
from kiln.errors import KilnError
from kiln.llm import LLM
from kiln.spec.loader import load_spec

DATA = Path(__file__).resolve().parents[2] / "bench" / "data"


def _spec(tmp_path: Path, line: str, base: str = "tiny-llama") -> Path:
    text = Path(load_spec(base).path).read_text().replace("compile {\n", f"compile {{\n  {line}\n")
    path = tmp_path / "s.kiln"
    path.write_text(text)
    return path


@pytest.mark.parametrize("drafter", ["self(layers = 1, k = 2)", "ngram(n = 2, k = 3)"])
def test_any_speculation_on_a_routed_target_is_refused_by_name(drafter):
    with pytest.raises(KilnError, match=r"speculation .*not built for Mixture-of-Depths.*speculation off"):
        LLM("tiny-llama-mod", device="cpu", speculation=drafter)


@pytest.mark.parametrize(("draft", "needle"), [
    ('draft(spec = "tiny-llama-mod", k = 2)', "routes layers"),
    ('draft(spec = "qwen2.5-0.5b", k = 3)', "151936 ids in the draft's, 512 in the target's"),
    ('draft(weights = "no-such-dir", k = 3)', "cannot load the draft model"),
    ('draft(spec = "no-such.kiln", k = 3)', "cannot load the draft model"),
])
def test_bad_drafts_fail_before_any_weights_load_and_in_kiln_check(tmp_path, monkeypatch, capsys, draft, needle):
    path = _spec(tmp_path, f"speculation = {draft}")
    assert main(["check", str(path)]) == 2
    err = capsys.readouterr().err
    assert needle in err and "speculation draft(" in err and "s.kiln:22:3" in err
    target = load_model(path, None, device="cpu")

    def never(*a, **k):
        raise AssertionError("the draft's weights were loaded before its config was checked")

    monkeypatch.setattr(speculation, "load_model", never)
    with pytest.raises(KilnError, match=needle):
        speculation.prepare_drafter(speculation.resolve_speculation(None, target), target)


def test_a_good_draft_passes_check_and_loads(tmp_path, capsys):
    path = _spec(tmp_path, 'speculation = draft(spec = "tiny-llama", k = 2)')
    assert main(["check", str(path)]) == 0
    assert "speculation draft" in capsys.readouterr().out
    target = load_model(path, None, device="cpu")
    plan = speculation.prepare_drafter(speculation.resolve_speculation(None, target), target)
    assert plan.draft is not None and plan.draft.model.name == "tiny-llama"


def test_route_in_the_compile_block_says_where_it_belongs(tmp_path, capsys):
    path = _spec(tmp_path, "route = mod(capacity = 0.5, every = 2)")
    assert main(["check", str(path)]) == 2
    assert "move the line into the model block" in capsys.readouterr().err


def test_hidden_without_a_predictor_is_refused(tmp_path, capsys):
    argv = ["train-router", "tiny-llama", "--text", str(DATA / "shakespeare-calibration.txt"), "--capacity", "0.5",
            "--hidden", "8", "-o", str(tmp_path / "r.safetensors")]
    assert main(argv) == 2
    assert "--hidden 8 sets the width of a predictor" in capsys.readouterr().err
    assert not (tmp_path / "r.safetensors").exists()


def test_kiln_run_names_the_served_form_and_why_one_request_saves_no_kv(capsys):
    assert main(["run", "tiny-llama-mod", "--prompt-ids", "1,2,3", "--max-tokens", "2", "--device", "cpu"]) == 0
    err = capsys.readouterr().err
    assert "served in the causal form" in err and "one request saves no memory" in err


def test_a_spec_error_inside_the_draft_is_reported_as_the_drafts(tmp_path):
    """A `kiln quantize` dir whose spec.kiln is broken: the SpecError raised while loading the draft becomes one
    message naming the speculation setting (not an AttributeError from rebuilding the SpecError)."""
    from kiln.compile.quantized import META, SPEC, TENSORS

    d = tmp_path / "q"
    d.mkdir()
    (d / META).write_text("{}")
    (d / TENSORS).write_bytes(b"")
    (d / SPEC).write_text("model {{{ broken")
    with pytest.raises(KilnError, match=r"speculation draft\(.*cannot load the draft model"):
        LLM("tiny-llama", device="cpu", speculation={"kind": "draft", "spec": "tiny-llama", "weights": str(d)})
