"""`kiln run --weights` and `kiln import` on tiny HF checkpoints, against transformers' greedy generate."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch

from kiln.cli.commands import main
from kiln.errors import KilnError
from tests.support.hf_models import FAMILIES, prompts, save_hf_model

NEW_TOKENS = 12


@pytest.fixture(scope="module", params=FAMILIES)
def checkpoint(request, tmp_path_factory):
    d = tmp_path_factory.mktemp(f"ckpt-{request.param}")
    model = save_hf_model(request.param, d)
    return request.param, model, d


def hf_greedy(model, ids: list[int]) -> list[int]:
    row = torch.tensor([ids])
    with torch.no_grad():
        out = model.generate(row, attention_mask=torch.ones_like(row), do_sample=False, max_new_tokens=NEW_TOKENS)
    return out[0, len(ids):].tolist()


def run_json(capsys, *argv: str) -> dict:
    assert main(list(argv)) == 0
    return json.loads(capsys.readouterr()[0])


def test_run_with_weights_matches_hf_greedy(capsys, checkpoint):
    family, model, d = checkpoint
    ids = prompts(batch=1, length=11, seed=5)[0].tolist()
    want = hf_greedy(model, ids)
    assert len(set(want)) >= 3, f"HF greedy output too repetitive to be a useful oracle: {want}"
    got = run_json(capsys, "run", "--weights", str(d), "--prompt-ids", ",".join(map(str, ids)),
                   "--temperature", "0", "--max-tokens", str(NEW_TOKENS), "--json")
    assert got["token_ids"] == want
    assert got["prompt_token_ids"] == ids


def test_import_writes_a_spec_that_checks_and_runs_the_same(capsys, checkpoint, tmp_path):
    family, model, d = checkpoint
    spec = tmp_path / f"{family}.kiln"
    assert main(["import", str(d), "-o", str(spec), "--name", f"tiny-{family}"]) == 0
    capsys.readouterr()
    assert main(["check", str(spec)]) == 0
    assert ": ok" in capsys.readouterr()[0]
    ids = prompts(batch=1, length=9, seed=6)[0].tolist()
    got = run_json(capsys, "run", str(spec), "--weights", str(d), "--prompt-ids", ",".join(map(str, ids)),
                   "--temperature", "0", "--max-tokens", str(NEW_TOKENS), "--json")
    assert got["token_ids"] == hf_greedy(model, ids)
    assert got["model"] == f"tiny-{family}"


def test_a_spec_sized_otherwise_than_the_checkpoint_names_the_field_and_both_sizes(capsys, tmp_path):
    # the spec's fault, not the checkpoint's: the tensors' shapes (tests/hf/test_weights.py) follow from its sizes
    save_hf_model("llama", tmp_path / "a")
    spec = tmp_path / "wide.kiln"
    assert main(["import", str(tmp_path / "a"), "-o", str(spec)]) == 0
    spec.write_text(spec.read_text().replace("ffn = 64", "ffn = 48"))
    code = main(["run", str(spec), "--weights", str(tmp_path / "a"), "--prompt-ids", "3,4"])
    err = capsys.readouterr()[1]
    assert code == 2
    assert "ffn: 48 in the spec, 64 in the checkpoint; fix the spec" in err
    assert "Traceback" not in err


def test_weights_dir_without_config_is_a_clean_error(capsys, tmp_path):
    code = main(["run", "--weights", str(tmp_path), "--prompt-ids", "3"])
    assert code == 2
    assert "config.json" in capsys.readouterr()[1]


@pytest.mark.parametrize(
    "old, new, words",
    [
        (", window = 4)", ")", "attn0 window: none in the spec, 4 in the checkpoint"),  # Mistral's window dropped
        ("theta = 10000", "theta = 500000", "rope theta: 500000 in the spec, 10000 in the checkpoint"),
        ("eps = 1e-06", "eps = 1e-05", "norm eps: 1e-05 in the spec, 1e-06 in the checkpoint"),
        ("heads = 4\n  kv_heads = 2\n  head_dim = 8", "heads = 8\n  kv_heads = 4\n  head_dim = 4",
         "heads: 8 in the spec, 4 in the checkpoint"),  # the same tensor shapes, split otherwise
    ],
)
def test_a_spec_that_differs_from_the_checkpoints_config_is_refused(capsys, tmp_path, old, new, words):
    # these run without any shape error: kiln used to serve the spec's model on the checkpoint's weights silently
    save_hf_model("mistral", tmp_path / "m")
    spec = tmp_path / "m.kiln"
    assert main(["import", str(tmp_path / "m"), "-o", str(spec)]) == 0
    assert old in spec.read_text(), spec.read_text()
    spec.write_text(spec.read_text().replace(old, new))
    code = main(["run", str(spec), "--weights", str(tmp_path / "m"), "--prompt-ids", "3,4", "--max-tokens", "1"])
    err = capsys.readouterr()[1]
    assert code == 2 and words in err and "does not describe the checkpoint" in err, err


def test_equivalent_specs_are_not_refused():
    """A window that spans the served context masks nothing; the per-site rope flag means nothing without rope."""
    from kiln.hf.spec_match import check_spec_matches
    from kiln.spec.loader import load_spec

    mistral = load_spec("mistral-7b-v0.1").model
    short = dataclasses.replace(mistral, context=4096)
    no_window = dataclasses.replace(short, body=tuple(
        dataclasses.replace(a, value=_drop_window(a.value)) for a in short.body))
    check_spec_matches(no_window, mistral, "spec", "checkpoint")  # 4096 served: Mistral's window 4096 is no window
    with pytest.raises(KilnError, match="window: none in the spec, 4096 in the checkpoint"):
        check_spec_matches(dataclasses.replace(no_window, context=8192), mistral, "spec", "checkpoint")
    # a checkpoint whose window spans its own short context still slides when a spec serves more
    with pytest.raises(KilnError, match="window: none in the spec, 4096 in the checkpoint"):
        check_spec_matches(dataclasses.replace(no_window, context=8192), short, "spec", "checkpoint")
    gpt2 = load_spec("gpt2").model
    no_rope_flag = dataclasses.replace(gpt2, body=tuple(
        dataclasses.replace(a, value=_set_rope(a.value, False)) for a in gpt2.body))
    check_spec_matches(no_rope_flag, gpt2, "spec", "checkpoint")


def _drop_window(expr):
    return _map_calls(expr, lambda c: dataclasses.replace(c, window=None) if hasattr(c, "window") else c)


def _set_rope(expr, on):
    return _map_calls(expr, lambda c: dataclasses.replace(c, rope=on) if hasattr(c, "rope") else c)


def _map_calls(expr, f):
    if dataclasses.is_dataclass(expr):
        changes = {fl.name: _map_calls(getattr(expr, fl.name), f) for fl in dataclasses.fields(expr)
                   if dataclasses.is_dataclass(getattr(expr, fl.name)) or isinstance(getattr(expr, fl.name), tuple)}
        return f(dataclasses.replace(expr, **changes))
    if isinstance(expr, tuple):
        return tuple(_map_calls(e, f) for e in expr)
    return expr
