"""--async-scheduling with what it is not built for (speculation, --no-overlap-outputs): the CLI names its flags and
their fix; the Python API (Engine, LLM) keeps its argument names."""

from __future__ import annotations

import pytest

from kiln.cli.commands import main
from kiln.runtime.engine import Engine
from kiln.runtime.engine_setup import AsyncSchedulingError
from kiln.runtime.speculative import NgramDrafter
from tests.support.speculative import spec_models

RUN = ["run", "tiny-llama", "--prompt", "hi", "--max-tokens", "2"]


@pytest.mark.parametrize(("flags", "want"), [
    (["--speculation", "ngram", "--async-scheduling"],
     "kiln: error: --async-scheduling is not built for speculative decoding (the drafter reads the last step's "
     "tokens on the host); drop --async-scheduling (or give --no-async-scheduling), or turn speculation off with "
     "--speculation off\n"),
    (["--no-overlap-outputs", "--async-scheduling"],
     "kiln: error: --async-scheduling makes every output come one step later, as --overlap-outputs does: it is not "
     "built with --no-overlap-outputs; drop --async-scheduling or --no-overlap-outputs\n"),
], ids=["speculation", "no overlap"])
def test_the_cli_names_its_flags(flags, want, capsys):
    assert main([*RUN, *flags]) == 2
    err = capsys.readouterr().err
    assert err.endswith(want)
    assert "async_scheduling" not in err and "overlap_outputs" not in err


def test_the_python_api_names_its_arguments():
    sm = spec_models()
    m = sm.loaded
    with pytest.raises(AsyncSchedulingError) as info:
        Engine(sm.target, m.tokenizer, m.model, drafter=NgramDrafter(), async_scheduling=True)
    assert str(info.value) == ("async_scheduling is not built for speculative decoding (the drafter reads the last "
                               "step's tokens on the host); leave async_scheduling unset (or False)")
    with pytest.raises(AsyncSchedulingError) as info:
        Engine(sm.target, m.tokenizer, m.model, overlap_outputs=False, async_scheduling=True)
    assert str(info.value) == ("async_scheduling makes every output come one step later, as overlap_outputs does: it "
                               "is not built with overlap_outputs off; leave one of them unset")
    engine = Engine(sm.target, m.tokenizer, m.model, drafter=NgramDrafter())
    with pytest.raises(AsyncSchedulingError, match="leave async_scheduling unset"):  # the switch, set later
        engine.async_scheduling = True
