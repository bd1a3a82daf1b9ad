"""`kiln run` fits a checkpoint's default max_tokens (generation_config.json's max_new_tokens) to the context by the
engine's rule (kiln.runtime.prompt_limits.resolve_max_tokens), as LLM and the server do: cut to what the context
leaves after the prompt, and a prompt that leaves no room is refused with the same message as theirs."""

from __future__ import annotations

import json

import pytest

from kiln.cli.commands import main
from tests.support.hf_models import save_hf_model

CTX = 64  # the test checkpoints' max_position_embeddings


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    d = tmp_path_factory.mktemp("ckpt")
    save_hf_model("llama", d)
    # a default far past the context; an eos past the vocabulary, so greedy runs to the limit
    (d / "generation_config.json").write_text(
        json.dumps({"temperature": 0.0, "max_new_tokens": 100000, "eos_token_id": 287}))
    return d


def ids(n: int) -> str:
    return ",".join(str(5 + i % 50) for i in range(n))


def test_run_cuts_the_checkpoints_default_max_tokens_to_the_context(capsys, checkpoint):
    assert main(["run", str(checkpoint), "--prompt-ids", ids(CTX - 4), "--json"]) == 0
    got = json.loads(capsys.readouterr().out)
    assert len(got["token_ids"]) == 4 and got["finish_reason"] == "length"


def test_run_refuses_a_prompt_that_fills_the_context_under_a_default(capsys, checkpoint):
    assert main(["run", str(checkpoint), "--prompt-ids", ids(CTX)]) == 2
    err = capsys.readouterr().err
    assert f"the prompt has {CTX} input tokens and this model's maximum context length is {CTX} tokens" in err
    assert "leaves no room to generate" in err


def test_run_checks_a_max_tokens_given_as_a_flag(capsys, checkpoint):
    assert main(["run", str(checkpoint), "--prompt-ids", ids(CTX - 4), "--max-tokens", "5"]) == 2
    assert "exceeds the model context of 64" in capsys.readouterr().err
