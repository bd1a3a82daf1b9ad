"""The HTTP server over an engine with overlap_outputs on: the same completions, streams and stop strings as off
(the engine thread steps while anything, a not yet made output included, is unfinished)."""

from __future__ import annotations

import pytest

from tests.support.served_llm import serve_llm

openai = pytest.importorskip("openai")


def test_completions_and_streams_are_the_same_with_overlap(llm):
    def run(overlap: bool) -> list:
        llm.engine.overlap_outputs = overlap
        with serve_llm(llm, engine=llm.engine) as url:
            client = openai.OpenAI(base_url=f"{url}/v1", api_key="none", timeout=60, max_retries=0)
            kw = dict(model="tiny-llama", temperature=0, extra_body={"return_token_ids": True})
            whole = client.completions.create(prompt="Hi", max_tokens=24, **kw).choices[0]
            stop = next(whole.text[i : i + 2] for i in range(2, len(whole.text) - 1)
                        if "\ufffd" not in whole.text[i : i + 2])
            stopped = client.completions.create(prompt="Hi", max_tokens=24, stop=[stop], **kw).choices[0]
            chunks = [c.choices[0] for c in client.completions.create(prompt="Once", max_tokens=10, stream=True,
                                                                      **kw) if c.choices]
            seeded = client.completions.create(prompt="abc", max_tokens=8, n=2, seed=3, **{**kw, "temperature": 1})
        return [(whole.text, whole.token_ids, whole.finish_reason), (stopped.text, stopped.finish_reason, stop),
                [(c.text, c.token_ids, c.finish_reason) for c in chunks],
                [(c.text, c.token_ids) for c in seeded.choices]]

    off = run(False)
    assert run(True) == off
    assert off[1][1] == "stop" and off[1][0] == off[0][0][: off[0][0].index(off[1][2])]
