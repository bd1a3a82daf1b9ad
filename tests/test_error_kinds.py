"""Errors of the right kind (docs/ARCHITECTURE.md): a caller's mistake is a KilnError subclass (one line, exit 2
from the CLI), a failure no input should cause is an InternalError (its traceback kept, "this is a bug in kiln").
These are the places that raised plain ValueError / RuntimeError instead; ServerConfig's is in
tests/server/test_server_internal_errors.py."""

from __future__ import annotations

import pytest
import torch

from kiln.chat_template import DEFAULT_CHAT_TEMPLATE, ChatTemplate
from kiln.cli.commands import main
from kiln.errors import InternalError, KilnError, RequestError
from kiln.ir.frontend import build_graph
from kiln.spec.loader import load_spec
from kiln.train.router_fit import _layer_stats

MSGS = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Once upon"}]


def test_render_refuses_continue_and_a_generation_prompt_together_as_a_request_error():
    with pytest.raises(RequestError, match="continue_final_message and add_generation_prompt cannot both be true") \
            as e:
        ChatTemplate(DEFAULT_CHAT_TEMPLATE).render(MSGS, True, continue_final_message=True)
    assert e.value.param == "continue_final_message"
    assert isinstance(e.value, ValueError)  # what transformers' apply_chat_template raises for the same call


def test_a_router_fit_that_finds_no_routed_attention_is_an_internal_error():
    cfg = load_spec("tiny-llama-mod").model
    gm = build_graph(cfg, mod_form="causal")
    with pytest.raises(InternalError, match="routed layer #7 has no kiln::routed_attention") as e:
        _layer_stats(gm, torch.zeros(1, 8, dtype=torch.long), 7)  # it has fewer routed layers than 8
    assert "this is a bug in kiln" in str(e.value) and not isinstance(e.value, KilnError)


@pytest.mark.parametrize("argv", [
    ["bench", "throughput", "tiny-llama", "--input-len", "x:3"],
    ["bench", "throughput", "tiny-llama", "--output-len", "9:3"],
    ["bench", "serve", "--input-len", "0"],
], ids=["throughput not a number", "throughput reversed", "serve zero"])
def test_a_bad_length_range_is_a_user_error_naming_the_flags(argv, capsys):
    """runtime.throughput.parse_range raises ValueError; its callers name the flags (its comment says so)."""
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("kiln: error: --input-len / --output-len: ") and "Traceback" not in err
