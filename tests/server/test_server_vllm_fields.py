"""What a tester comparing with vLLM found in chat content and choices: OpenAI's multi-part message content is
flattened by one function (kiln.chat_template.message_text) for `kiln serve` and LLM.chat alike, its text parts
joined with "\\n" as vLLM joins them; and every choice carries vLLM's stop_reason (the stop string or stop token id
that ended it, null otherwise), streamed (on the chunk with finish_reason) or not."""

from __future__ import annotations

import asyncio
import json

import pytest

from kiln.errors import RequestError
from kiln.runtime.request import CompletionOutput, RequestMetrics, RequestOutput
from kiln.server.streaming import Choices, completion_body, sse_stream

httpx = pytest.importorskip("httpx")

PARTS = [{"role": "system", "content": "Be brief."},
         {"role": "user", "content": [{"type": "text", "text": "Hi"}, {"type": "text", "text": "there"}]}]
JOINED = [PARTS[0], {"role": "user", "content": "Hi\nthere"}]
GREEDY = {"temperature": 0, "max_tokens": 5, "ignore_eos": True}


def _post(url: str, path: str, body: dict) -> httpx.Response:
    return httpx.post(f"{url}{path}", json=body, timeout=60)


def _events(r: httpx.Response) -> list[dict]:
    return [json.loads(line[6:]) for line in r.text.splitlines() if line.startswith("data: {")]


def test_message_text_flattens_as_vllm():
    from kiln.chat_template import message_text

    assert message_text(None) == "" and message_text("a b") == "a b"
    assert message_text([{"type": "text", "text": "a"}, {"type": "text", "text": "b"}, {"type": "text", "text": ""}]) \
        == "a\nb\n"
    for bad, what in (([{"type": "image_url", "image_url": {"url": "x"}}], "'image_url'"), (["a"], "'str'"),
                      ([{"text": "no type"}], "None"), ([{"type": "text", "text": 5}], "string \"text\""),
                      (5, "not int")):
        with pytest.raises(RequestError, match=what) as e:
            message_text(bad)
        assert e.value.param == "messages"


def test_llm_chat_takes_content_parts(llm):
    from kiln import SamplingParams

    before = json.dumps(PARTS)
    assert llm.chat_prompts(PARTS) == llm.chat_prompts(JOINED) == ["<|system|>\nBe brief.\n<|user|>\nHi\nthere\n"
                                                                   "<|assistant|>\n"]
    params = SamplingParams(**GREEDY)
    (a,), (b,) = llm.chat(PARTS, params), llm.chat(JOINED, params)
    assert a.prompt_token_ids == b.prompt_token_ids and a.outputs[0].token_ids == b.outputs[0].token_ids
    assert json.dumps(PARTS) == before  # the caller's messages are not rewritten
    image = [{"role": "user", "content": [{"type": "text", "text": "look"}, {"type": "image_url", "image_url": {}}]}]
    with pytest.raises(RequestError, match="conversation 0: message content part of type 'image_url' is not "
                                           "supported; only text parts are"):
        llm.chat(image)


def test_server_chat_flattens_as_llm_chat(url, llm):
    from kiln import SamplingParams

    r = _post(url, "/v1/chat/completions", {"messages": PARTS, "return_token_ids": True, **GREEDY}).json()
    (want,) = llm.chat(PARTS, SamplingParams(**GREEDY))
    assert r["usage"]["prompt_tokens"] == len(want.prompt_token_ids)
    assert r["choices"][0]["token_ids"] == want.outputs[0].token_ids
    assert r["choices"][0]["message"]["content"] == want.outputs[0].text
    bad = _post(url, "/v1/chat/completions", {"messages": [{"role": "user", "content": [{"type": "input_audio"}]}]})
    assert bad.status_code == 400 and "'input_audio'" in bad.json()["error"]["message"]
    assert bad.json()["error"]["param"] == "messages"


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_choices_carry_vllms_stop_reason(url, path, stream):
    chat = path.endswith("chat/completions")
    base = {"messages": [{"role": "user", "content": "Hi"}]} if chat else {"prompt": "Hi"}
    base = {**base, **GREEDY, "max_tokens": 24}
    probe = _post(url, path, {**base, "return_token_ids": True}).json()["choices"][0]
    text, ids = probe["message"]["content"] if chat else probe["text"], probe["token_ids"]
    stop = next(ch for ch in text[1:] if ch != "\ufffd")  # random weights: mostly broken bytes, some characters
    for extra, finish, reason in (({"stop": [stop]}, "stop", stop), ({"stop_token_ids": [ids[4]]}, "stop", ids[4]),
                                  ({}, "length", None)):
        r = _post(url, path, {**base, "stream": stream, **extra})
        assert r.status_code == 200, r.text
        if not stream:
            choice = r.json()["choices"][0]
            assert (choice["finish_reason"], choice["stop_reason"]) == (finish, reason), extra
            continue
        choices = [c for e in _events(r) for c in e["choices"]]
        assert [c["stop_reason"] for c in choices[:-1]] == [None] * (len(choices) - 1)  # the key on every chunk
        assert (choices[-1]["finish_reason"], choices[-1]["stop_reason"]) == (finish, reason), extra


def _output(finish: str | None, stop_reason: int | str | None) -> RequestOutput:
    comp = CompletionOutput(0, [5], "x", finish, stop_reason, delta_token_ids=[5], delta_text="x")
    return RequestOutput("r", None, [1], [comp], finish is not None, RequestMetrics(arrival_time=0.0))


@pytest.mark.parametrize("reported", [None, 2, "END"])
def test_a_choice_carries_the_engines_stop_reason(reported):
    """The engine reports vLLM's stop_reason (Request.reported_stop_reason: None for eos); each choice passes it on,
    streamed on the chunk with finish_reason only."""
    c = Choices("cmpl-1", "text_completion", "m", ["r"], 1)
    c.update(_output("stop", reported))
    assert completion_body(c)["choices"][0]["stop_reason"] == reported

    async def stream() -> list[str]:
        sink: asyncio.Queue = asyncio.Queue()
        sink.put_nowait(_output(None, None))
        sink.put_nowait(_output("stop", reported))
        choices = Choices("cmpl-2", "chat.completion", "m", ["r"], 1)
        return [e async for e in sse_stream(sink, choices, False)]

    events = [json.loads(e[6:]) for e in asyncio.run(stream()) if e.startswith("data: {")]
    assert [e["choices"][0]["stop_reason"] for e in events] == [None, None, reported]  # the role chunk first


def test_a_chat_stream_opens_with_a_role_chunk_per_choice_as_vllm(url):
    """OpenAI's and vLLM's chat stream: first, for every choice, a chunk whose delta is the role with empty content
    (no logprobs, no tokens); then deltas of content alone, each with the logprobs (and token ids) of the tokens it
    carries; together what the body without stream holds."""
    body = {"messages": [{"role": "user", "content": "Hi"}], "n": 2, "logprobs": True, "top_logprobs": 1,
            **GREEDY, "max_tokens": 6, "return_token_ids": True}
    whole = _post(url, "/v1/chat/completions", body).json()["choices"]
    r = _post(url, "/v1/chat/completions", {**body, "stream": True, "stream_options": {"include_usage": True}})
    events = _events(r)
    assert events[-1]["choices"] == [] and events[-1]["usage"]["completion_tokens"] == 12
    chunks = [e["choices"] for e in events[:-1]]
    assert all(len(c) == 1 for c in chunks) and all(e["usage"] is None for e in events[:-1])
    assert [c[0] for c in chunks[:2]] == [
        {"index": i, "delta": {"role": "assistant", "content": ""}, "logprobs": None, "finish_reason": None,
         "stop_reason": None, "token_ids": []} for i in range(2)]
    rest = [c[0] for c in chunks[2:]]
    assert rest and all(list(c["delta"]) == ["content"] for c in rest)  # the role once, content alone after it
    for i, want in enumerate(whole):
        mine = [c for c in rest if c["index"] == i]
        assert "".join(c["delta"]["content"] for c in mine) == want["message"]["content"]
        assert [t for c in mine for t in c["token_ids"]] == want["token_ids"]
        for c in mine:  # a token's logprobs ride with the chunk that carries it
            assert len((c["logprobs"] or {"content": []})["content"]) == len(c["token_ids"]), c
        entries = [e for c in mine if c["logprobs"] for e in c["logprobs"]["content"]]
        assert [e["token"] for e in entries] == [e["token"] for e in want["logprobs"]["content"]]
        assert mine[-1]["finish_reason"] == "length"


def test_llm_chat_continues_the_final_message_as_the_server_does(url, llm):
    """LLM.chat takes vLLM's add_generation_prompt and continue_final_message, giving the prompt (and so the reply)
    the server gives for the same fields; both true is refused naming both."""
    from kiln import SamplingParams

    msgs = [*JOINED, {"role": "assistant", "content": "Sure, "}]
    assert llm.chat_prompts(msgs, add_generation_prompt=False, continue_final_message=True) == [
        "<|system|>\nBe brief.\n<|user|>\nHi\nthere\n<|assistant|>\nSure, "]
    assert llm.chat_prompts(JOINED, add_generation_prompt=False) == ["<|system|>\nBe brief.\n<|user|>\nHi\nthere\n"]
    (want,) = llm.chat(msgs, SamplingParams(**GREEDY), add_generation_prompt=False, continue_final_message=True)
    r = _post(url, "/v1/chat/completions", {"messages": msgs, "return_token_ids": True, "add_generation_prompt": False,
                                            "continue_final_message": True, **GREEDY}).json()
    assert r["usage"]["prompt_tokens"] == len(want.prompt_token_ids)
    assert r["choices"][0]["token_ids"] == want.outputs[0].token_ids
    with pytest.raises(RequestError, match="continue_final_message and add_generation_prompt cannot both be true"):
        llm.chat(msgs, continue_final_message=True)
    with pytest.raises(RequestError, match="the final message has no content to continue"):
        llm.chat([*JOINED, {"role": "assistant", "content": None}], add_generation_prompt=False,
                 continue_final_message=True)
