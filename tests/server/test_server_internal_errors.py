"""The server's split between a client's mistake and kiln's: a prompt the tokenizer refuses (a KilnError) is a 400
naming the field; any other failure while tokenizing is a bug, a 500 whose traceback is logged on `kiln.server`;
an engine step that raises fails the requests in flight and is logged there with its traceback (it was printed)."""

from __future__ import annotations

import logging
from types import SimpleNamespace

import pytest

from kiln.errors import UsageError
from kiln.runtime.engine import Engine
from kiln.server import ServerConfig, build_app
from kiln.server.prompt_tokens import _encode
from kiln.server.protocol import APIError
from kiln.tokenizer import ByteTokenizer
from tests.support.fake_step import FakeStepModel, fake_config

pytest.importorskip("httpx")
V = 97  # the byte-level tokenizer of a 97-token vocabulary refuses "i" (byte 105)


class BrokenTokenizer(ByteTokenizer):
    def encode(self, text: str) -> list[int]:
        return [1] if text == "ok" else [1 // 0]


class FailingStep(Engine):
    """An engine whose first step raises, as a bug in a kernel or the scheduler would."""

    failed = False

    def step(self):
        if not self.failed:
            self.failed = True
            raise ZeroDivisionError("step boom")
        return super().step()


def _client(engine: Engine):
    from starlette.testclient import TestClient

    # by hand, not serve_llm: an app over a fake engine (no LLM), asked in process
    return TestClient(build_app(engine, ServerConfig(model_name="fake")))


def _bugs(caplog) -> list[logging.LogRecord]:
    return [r for r in caplog.records if r.exc_info is not None]


def test_encode_makes_a_refused_text_a_400_and_lets_a_bug_through():
    with pytest.raises(APIError) as e:
        _encode(SimpleNamespace(tokenizer=ByteTokenizer(V)), "Hi", True, "prompt", what="prompt")
    assert e.value.status == 400 and e.value.param == "prompt" and "the prompt cannot be tokenized" in str(e.value)
    with pytest.raises(ZeroDivisionError):  # not a 400 blaming the client's text
        _encode(SimpleNamespace(tokenizer=BrokenTokenizer(V)), "Hi", True, "prompt")


def test_a_tokenizer_bug_is_a_500_with_its_traceback_logged(caplog):
    caplog.set_level(logging.INFO, logger="kiln")
    eng = Engine(FakeStepModel(V), BrokenTokenizer(V), fake_config(64), block_size=4, num_blocks=32)
    with _client(eng) as c:
        r = c.post("/v1/completions", json={"model": "fake", "prompt": "Hi", "max_tokens": 2})
        assert r.status_code == 500, r.text
        err = r.json()["error"]
        assert err["type"] == "internal_error" and "this is a bug in kiln" in err["message"]
        assert [r.exc_info[0] for r in _bugs(caplog)] == [ZeroDivisionError]
        ok = c.post("/v1/completions", json={"model": "fake", "prompt": "ok", "max_tokens": 2})
        assert ok.status_code == 200, ok.text  # still serving


def test_a_text_the_byte_tokenizer_refuses_is_a_400(caplog):
    eng = Engine(FakeStepModel(V), ByteTokenizer(V), fake_config(64), block_size=4, num_blocks=32)
    with _client(eng) as c:
        r = c.post("/v1/completions", json={"model": "fake", "prompt": "Hi", "max_tokens": 2})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == "prompt" and "needs ids up to 105" in err["message"]
    assert not _bugs(caplog)


def test_an_engine_step_failure_is_logged_with_its_traceback(caplog):
    caplog.set_level(logging.INFO, logger="kiln")
    eng = FailingStep(FakeStepModel(V), ByteTokenizer(V), fake_config(64), block_size=4, num_blocks=32)
    with _client(eng) as c:
        r = c.post("/v1/completions", json={"model": "fake", "prompt": [1, 2], "max_tokens": 2})
        assert r.status_code >= 500 and "the engine failed during a step (ZeroDivisionError: step boom)" in r.text
        assert c.post("/v1/completions", json={"model": "fake", "prompt": [1, 2], "max_tokens": 2}).status_code == 200
    (rec,) = _bugs(caplog)
    assert rec.name == "kiln.server" and rec.levelno == logging.ERROR and rec.exc_info[0] is ZeroDivisionError
    assert "this is a bug in kiln" in rec.getMessage()


def test_a_server_config_without_model_ids_is_a_usage_error():
    eng = Engine(FakeStepModel(V), ByteTokenizer(V), fake_config(64), block_size=4, num_blocks=32)
    for bad in ("", [], [""]):
        with pytest.raises(UsageError, match="model_name: give one or more non-empty model ids"):
            build_app(eng, ServerConfig(model_name=bad))  # what a Python caller of the server sees
