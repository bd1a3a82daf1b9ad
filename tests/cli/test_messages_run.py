"""`kiln run` / `kiln serve` messages give a fix the user can apply with the command used: a prompt that alone fills
the context says to shorten it (not to lower --max-tokens), a KV pool too small names the command's own flags
(kiln run has --max-tokens, not --max-model-len), and sampling ranges say what is really allowed."""

from __future__ import annotations

import pytest

from kiln.cli.commands import main

CTX = 256  # tiny-llama's context


def _err(capsys, *argv: str) -> str:
    assert main(list(argv)) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err, err
    return err


def test_run_with_a_prompt_over_the_context_says_shorten_the_prompt(capsys):
    ids = ",".join(["5"] * (CTX + 147))
    err = _err(capsys, "run", "tiny-llama", "--device", "cpu", "--prompt-ids", ids, "--max-tokens", "4")
    assert f"the prompt has {CTX + 147} input tokens and this model's maximum context length is {CTX} tokens" in err
    assert err.rstrip().endswith("leaves no room to generate; shorten the prompt"), err
    assert "max_tokens" not in err and "max-tokens" not in err, err


def test_run_with_a_pool_too_small_names_run_flags(capsys):
    err = _err(capsys, "run", "tiny-llama", "--device", "cpu", "--num-blocks", "3", "--prompt-ids", "1,2",
               "--max-tokens", "40")  # 42 tokens need 3 blocks of 16 + the null block; 3 blocks hold 32 tokens
    assert err.rstrip().endswith("; raise --num-blocks to at least 4, or lower --max-tokens to at most 30 (the pool "
                                 "holds 32 tokens, the prompt 2)"), err
    assert "max-model-len" not in err and "max_model_len" not in err and "LLM(" not in err, err


def test_run_with_a_prompt_that_fills_the_pool_says_shorten_it(capsys):
    ids = ",".join(["5"] * 40)
    err = _err(capsys, "run", "tiny-llama", "--device", "cpu", "--num-blocks", "3", "--prompt-ids", ids,
               "--max-tokens", "2")
    assert err.rstrip().endswith("; raise --num-blocks to at least 4, or shorten the prompt (its 40 tokens fill the "
                                 "pool's 32)"), err


def test_serve_with_a_pool_too_small_names_serve_flags(capsys):
    err = _err(capsys, "serve", "tiny-llama", "--device", "cpu", "--port", "0", "--num-blocks", "3")
    assert err.rstrip().endswith(f"one sequence of the longest allowed length ({CTX} tokens) needs 16 blocks plus "
                                 "the reserved null block = 17 (0.1 MiB); raise --num-blocks to at least 17, or lower "
                                 "--max-model-len"), err


@pytest.mark.parametrize(("flag", "value", "allowed"), [
    ("--top-k", "-3", "allowed: an integer top_k >= -1 (0 or -1 means off)"),
    ("--temperature", "inf", "allowed: a finite temperature >= 0 (0 means greedy)"),
    ("--repetition-penalty", "nan", "allowed: a finite repetition_penalty > 0 (1 means off)"),
])
def test_run_sampling_ranges_say_what_is_allowed(capsys, flag, value, allowed):
    err = _err(capsys, "run", "tiny-llama", "--device", "cpu", "--prompt-ids", "1,2", flag, value)
    assert allowed in err, err
