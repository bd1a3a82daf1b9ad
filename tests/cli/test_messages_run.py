"""`kiln run` / `kiln serve` messages give a fix the user can apply with the command used: a prompt that alone fills
the context says to shorten it (not to lower --max-tokens), a KV pool too small names the command's own flags
(kiln run has --max-tokens, not --max-model-len), and sampling ranges say what is really allowed, naming the flag
the user typed (--top-k), where the Python API names SamplingParams' field (top_k)."""

from __future__ import annotations

import json

import pytest

from kiln.cli.commands import main
from kiln.cli.run import SAMPLING_FLAGS
from kiln.errors import RequestError
from kiln.runtime.sampling_params import SamplingParams

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
    ("--top-k", "-3", "allowed: an integer --top-k >= -1 (0 or -1 means off)"),
    ("--temperature", "inf", "allowed: a finite --temperature >= 0 (0 means greedy)"),
    ("--repetition-penalty", "nan", "allowed: a finite --repetition-penalty > 0 (1 means off)"),
])
def test_run_sampling_ranges_say_what_is_allowed(capsys, flag, value, allowed):
    err = _err(capsys, "run", "tiny-llama", "--device", "cpu", "--prompt-ids", "1,2", flag, value)
    assert allowed in err, err


# An out-of-range value for each sampling flag of `kiln run` (SAMPLING_FLAGS, by SamplingParams field), and what
# the message then says
OUT_OF_RANGE = {
    "temperature": ("-1", "--temperature -1.0 is out of range; allowed: a finite --temperature >= 0 (0 means greedy)"),
    "top_k": ("-3", "--top-k -3 is out of range; allowed: an integer --top-k >= -1 (0 or -1 means off)"),
    "top_p": ("0", "--top-p 0.0 is out of range; allowed: 0 < --top-p <= 1 (1 means off)"),
    "min_p": ("2", "--min-p 2.0 is out of range; allowed: 0 <= --min-p <= 1 (0 means off; 1 keeps only the most "
              "likely tokens)"),
    "repetition_penalty": ("0", "--repetition-penalty 0.0 is out of range; allowed: a finite --repetition-penalty > 0 "
                           "(1 means off)"),
    # SamplingParams' "or None (up to the context)" is no value a flag can take: left out
    "max_tokens": ("0", "--max-tokens 0 is out of range; allowed: an integer --max-tokens >= 1"),
}


def test_every_sampling_flag_has_an_out_of_range_case():
    assert set(OUT_OF_RANGE) == set(SAMPLING_FLAGS)


@pytest.mark.parametrize("field", sorted(OUT_OF_RANGE))
def test_run_names_the_flag_of_an_out_of_range_sampling_value(capsys, field):
    """The user typed --top-k, not SamplingParams' top_k: the message names the flag, in its text and its range."""
    value, message = OUT_OF_RANGE[field]
    flag = "--" + field.replace("_", "-")
    err = _err(capsys, "run", "tiny-llama", "--device", "cpu", "--prompt-ids", "1,2", flag, value)
    assert err.rstrip().endswith(message), err
    assert field not in err.replace(flag, ""), err  # not the field's name anywhere


@pytest.mark.parametrize("field", sorted(OUT_OF_RANGE))
def test_the_python_api_still_names_the_field(field):
    """SamplingParams (LLM's) keeps its own names: only the CLI rewords."""
    value = float(OUT_OF_RANGE[field][0]) if field in ("temperature", "top_p", "min_p", "repetition_penalty") else \
        int(OUT_OF_RANGE[field][0])
    with pytest.raises(RequestError, match=rf"^sampling parameter {field} = ") as e:
        SamplingParams(**{field: value}).validate()
    assert "--" not in str(e.value) and e.value.param == field


def test_run_names_the_flag_of_a_max_tokens_past_the_context(capsys):
    err = _err(capsys, "run", "tiny-llama", "--device", "cpu", "--prompt-ids", "1,2", "--max-tokens", "300")
    assert err.rstrip().endswith("prompt of 2 tokens + --max-tokens 300 = 302 exceeds the model context of 256; "
                                 "shorten the prompt or lower --max-tokens to at most 254"), err


def test_run_cuts_its_own_default_max_tokens_to_the_context(capsys):
    """Without --max-tokens, kiln run's default (32) is cut to what the context leaves, as a checkpoint's is: a
    refusal would tell the user to lower a --max-tokens they never gave."""
    ids = ",".join(["5"] * (CTX - 6))
    assert main(["run", "tiny-llama", "--device", "cpu", "--prompt-ids", ids, "--temperature", "0", "--json"]) == 0
    got = json.loads(capsys.readouterr().out)
    assert len(got["token_ids"]) == 6 and got["finish_reason"] == "length"


def test_run_refuses_an_empty_stop_string_by_its_flag(capsys):
    with pytest.raises(SystemExit) as e:
        main(["run", "tiny-llama", "--prompt-ids", "1,2", "--stop="])
    assert e.value.code == 2
    assert "argument --stop: is empty; give the text to end generation at, or leave --stop out" in \
        capsys.readouterr().err
