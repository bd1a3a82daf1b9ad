"""vLLM's request fields that map onto SamplingParams (skip_special_tokens, spaces_between_special_tokens,
allowed_token_ids, truncate_prompt_tokens, min_p up to 1), chat's template fields (chat_template with
--trust-request-chat-template, chat_template_kwargs, reasoning_effort), add_special_tokens (completions: true, chat
and /tokenize's messages: false, so that the prompt is transformers' apply_chat_template(tokenize=True)), /detokenize
keeping special tokens' text, and the model's generation_config.json defaults for the fields a request leaves
unset, all through the real app."""

from __future__ import annotations

import json

import pytest

from kiln.chat_template import DEFAULT_CHAT_TEMPLATE, ChatTemplate
from tests.support.served_llm import llm_engine, serve_llm
from tests.support.word_tokenizer import BOS, write_word_tokenizer

httpx = pytest.importorskip("httpx")

MSGS = [{"role": "user", "content": "w1 w2"}]
# a template that reads Qwen3's enable_thinking and OpenAI's reasoning_effort, and writes BOS itself
THINKING = ("{{ bos_token }}{% for m in messages %}{{ m.content }} {% endfor %}{% if enable_thinking is defined and "
            "not enable_thinking %}w7 {% endif %}{% if reasoning_effort == 'high' %}w9 {% endif %}")


def _post(url: str, path: str, body: object) -> httpx.Response:
    return httpx.post(f"{url}{path}", json=body, timeout=60)


def _prompt_ids(r: httpx.Response) -> list[int]:
    """The prompt's ids a response shows with return_token_ids (completions: on the choice, chat: on the body)."""
    assert r.status_code == 200, r.text
    body = r.json()
    return body["prompt_token_ids"] if "prompt_token_ids" in body else body["choices"][0]["prompt_token_ids"]


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory):
    """A tokenizer.json of words w0 .. w9 and the special <s> (id 10) that its post-processor puts first."""
    d = tmp_path_factory.mktemp("tok")
    write_word_tokenizer(d)
    (d / "tokenizer_config.json").write_text(json.dumps({"bos_token": "<s>"}))
    return d


@pytest.fixture(scope="module")
def words_tok(tokenizer_dir):
    from kiln.tokenizer import HFTokenizer

    return HFTokenizer(tokenizer_dir / "tokenizer.json")


@pytest.fixture(scope="module")
def words(llm, words_tok):
    """A server whose model reads words, with kiln's default chat template (which writes no BOS)."""
    eng = llm_engine(llm, tokenizer=words_tok, num_blocks=48)
    with serve_llm(llm, engine=eng, chat_template=ChatTemplate(DEFAULT_CHAT_TEMPLATE, bos_token="<s>")) as u:
        yield u


@pytest.fixture(scope="module")
def trusting(llm, words_tok):
    """A server with a template that reads template variables, taking templates from requests."""
    with serve_llm(llm, engine=llm_engine(llm, tokenizer=words_tok, num_blocks=48),
                   chat_template=ChatTemplate(THINKING, bos_token="<s>"), trust_request_chat_template=True) as u:
        yield u


# ---- SamplingParams fields --------------------------------------------------------------------------------------


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_allowed_token_ids_and_special_tokens_text(words, path):
    """allowed_token_ids [<s>]: every sampled token is <s>; its text shows only with skip_special_tokens false, and
    spaces_between_special_tokens false drops the spaces between them (as vLLM's detokenizer)."""
    body = {"max_tokens": 3, "ignore_eos": True, "allowed_token_ids": [BOS], "return_token_ids": True}
    body |= {"prompt": "w1 w2"} if path == "/v1/completions" else {"messages": MSGS}

    def text(**kw) -> str:
        r = _post(words, path, {**body, **kw})
        assert r.status_code == 200, r.text
        choice = r.json()["choices"][0]
        assert choice["token_ids"] == [BOS] * 3
        return choice["text"] if path == "/v1/completions" else choice["message"]["content"]

    assert text() == ""
    # (the leading space: the word-level decoder joins the first output token to the prompt with one)
    assert text(skip_special_tokens=False) == " <s> <s> <s>"
    assert text(skip_special_tokens=False, spaces_between_special_tokens=False).lstrip() == "<s><s><s>"


def test_allowed_token_ids_errors_name_the_field(words):
    for bad in ([], [512]):
        r = _post(words, "/v1/completions", {"prompt": "w1", "max_tokens": 1, "allowed_token_ids": bad})
        assert r.status_code == 400 and r.json()["error"]["param"] == "allowed_token_ids", r.text
    r = _post(words, "/v1/completions", {"prompt": "w1", "skip_special_tokens": 1})
    assert r.status_code == 400 and r.json()["error"]["param"] == "skip_special_tokens", r.text


def test_truncate_prompt_tokens_keeps_the_prompts_last_tokens(url):
    ids = [5, 9, 44, 100, 7, 8, 200, 31, 17, 3]
    greedy = {"max_tokens": 4, "temperature": 0, "ignore_eos": True, "return_token_ids": True}
    cut = _post(url, "/v1/completions", {"prompt": ids, "truncate_prompt_tokens": 4, **greedy}).json()
    plain = _post(url, "/v1/completions", {"prompt": ids[-4:], **greedy}).json()
    assert cut["usage"]["prompt_tokens"] == 4 and cut["choices"][0]["prompt_token_ids"] == ids[-4:]
    assert cut["choices"][0]["token_ids"] == plain["choices"][0]["token_ids"]
    whole = _post(url, "/v1/completions", {"prompt": ids, "truncate_prompt_tokens": -1, **greedy}).json()
    assert whole["usage"]["prompt_tokens"] == len(ids)
    chat = _post(url, "/v1/chat/completions", {"messages": MSGS, "truncate_prompt_tokens": 3, **greedy}).json()
    assert chat["usage"]["prompt_tokens"] == 3
    # a prompt over the context, cut to fit, is served (-1: the last max_model_len; the output needs room too)
    r = _post(url, "/v1/completions", {"prompt": [5] * 300, "truncate_prompt_tokens": 200, **greedy})
    assert r.status_code == 200 and r.json()["usage"]["prompt_tokens"] == 200, r.text
    for bad, words in ((0, "out of range"), (-2, "out of range"), (257, "greater than max_model_len = 256")):
        r = _post(url, "/v1/completions", {"prompt": ids, "truncate_prompt_tokens": bad, **greedy})
        err = r.json()["error"]
        assert r.status_code == 400 and err["param"] == "truncate_prompt_tokens" and words in err["message"], r.text


def test_min_p_takes_one(url):
    r = _post(url, "/v1/completions", {"prompt": "Hi", "max_tokens": 2, "min_p": 1.0})
    assert r.status_code == 200, r.text
    r = _post(url, "/v1/completions", {"prompt": "Hi", "max_tokens": 2, "min_p": 1.5})
    assert r.status_code == 400 and r.json()["error"]["param"] == "min_p", r.text


# ---- add_special_tokens, and the chat prompt as transformers tokenizes it --------------------------------------


def test_add_special_tokens(words):
    base = {"max_tokens": 1, "return_token_ids": True}
    assert _prompt_ids(_post(words, "/v1/completions", {"prompt": "w1 w2", **base})) == [BOS, 1, 2]
    r = _post(words, "/v1/completions", {"prompt": "w1 w2", "add_special_tokens": False, **base})
    assert _prompt_ids(r) == [1, 2]
    chat = _prompt_ids(_post(words, "/v1/chat/completions", {"messages": MSGS, **base}))
    tok = _post(words, "/tokenize", {"messages": MSGS}).json()["tokens"]
    assert chat == tok and tok[0] != BOS  # the default template writes no BOS, and chat adds none, as vLLM
    with_bos = _post(words, "/v1/chat/completions", {"messages": MSGS, "add_special_tokens": True, **base})
    assert _prompt_ids(with_bos) == [BOS, *chat]
    assert _post(words, "/tokenize", {"messages": MSGS, "add_special_tokens": True}).json()["tokens"] == [BOS, *tok]


@pytest.mark.parametrize("template", [DEFAULT_CHAT_TEMPLATE, THINKING])
def test_the_chat_prompt_is_transformers_apply_chat_template_tokenized(llm, words_tok, tokenizer_dir, template):
    transformers = pytest.importorskip("transformers")
    hf = transformers.PreTrainedTokenizerFast(tokenizer_file=str(tokenizer_dir / "tokenizer.json"), bos_token="<s>")
    want = hf.apply_chat_template(MSGS, chat_template=template, tokenize=True, add_generation_prompt=True)
    want = list(want["input_ids"] if hasattr(want, "keys") else want)
    eng = llm_engine(llm, tokenizer=words_tok, num_blocks=48)
    with serve_llm(llm, engine=eng, chat_template=ChatTemplate(template, bos_token="<s>")) as u:
        r = _post(u, "/v1/chat/completions", {"messages": MSGS, "max_tokens": 1, "return_token_ids": True})
        assert _prompt_ids(r) == want
        assert _post(u, "/tokenize", {"messages": MSGS}).json()["tokens"] == want
    assert (want[0] == BOS) == (template == THINKING)  # a template that writes BOS has it once


# ---- chat templates from the request, template variables ---------------------------------------------------------


def _tokens(url: str, body: dict) -> httpx.Response:
    return _post(url, "/tokenize", {"messages": MSGS, **body})


def test_chat_template_kwargs_and_reasoning_effort_reach_the_template(trusting):
    assert _tokens(trusting, {}).json()["tokens"] == [BOS, 1, 2]
    assert _tokens(trusting, {"chat_template_kwargs": {"enable_thinking": False}}).json()["tokens"] == [BOS, 1, 2, 7]
    assert _tokens(trusting, {"reasoning_effort": "high"}).json()["tokens"] == [BOS, 1, 2, 9]
    r = _post(trusting, "/v1/chat/completions", {"messages": MSGS, "max_tokens": 1, "return_token_ids": True,
                                                  "chat_template_kwargs": {"enable_thinking": False},
                                                  "reasoning_effort": "high"})
    assert _prompt_ids(r) == [BOS, 1, 2, 7, 9]
    for bad in ({"messages": []}, ["enable_thinking"]):
        r = _tokens(trusting, {"chat_template_kwargs": bad})
        assert r.status_code == 400 and r.json()["error"]["param"] == "chat_template_kwargs", r.text


def test_a_request_template_needs_trust_request_chat_template(trusting, words):
    tpl = "{% for m in messages %}w3 {{ m.content }} {% endfor %}"
    assert _tokens(trusting, {"chat_template": tpl}).json()["tokens"] == [3, 1, 2]
    r = _post(trusting, "/v1/chat/completions", {"messages": MSGS, "max_tokens": 1, "return_token_ids": True,
                                                  "chat_template": tpl})
    assert _prompt_ids(r) == [3, 1, 2]
    assert _tokens(trusting, {"chat_template_kwargs": {"chat_template": tpl}}).json()["tokens"] == [3, 1, 2]
    r = _tokens(trusting, {"chat_template": "{% for %}"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "chat_template" and "does not parse" in r.text
    for body in ({"chat_template": tpl}, {"chat_template_kwargs": {"chat_template": tpl}}):
        for path in ("/tokenize", "/v1/chat/completions"):
            r = _post(words, path, {"messages": MSGS, "max_tokens": 1, **body} if path != "/tokenize"
                      else {"messages": MSGS, **body})
            err = r.json()["error"]
            assert r.status_code == 400 and err["param"] == "chat_template", r.text
            assert "--trust-request-chat-template" in err["message"]


def test_detokenize_keeps_special_tokens_text(words):
    r = _post(words, "/detokenize", {"tokens": [BOS, 1, 2]})
    assert r.status_code == 200 and r.json() == {"prompt": "<s> w1 w2"}, r.text


# ---- kiln serve: generation_config.json defaults, --chat-template, --max-model-len 4k ----------------------------

GEN = {"temperature": 0.6, "top_p": 0.9, "top_k": 20, "min_p": 0.05, "repetition_penalty": 1.1,
       "max_new_tokens": 7, "eos_token_id": 2}


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    from tests.support.hf_models import save_hf_model

    d = tmp_path_factory.mktemp("ckpt")
    save_hf_model("llama", d)
    (d / "generation_config.json").write_text(json.dumps(GEN))
    return d


@pytest.fixture
def served(monkeypatch):
    """`kiln serve` up to where uvicorn would run, and the SamplingParams every engine request got."""
    from kiln.runtime.engine import Engine
    from kiln.server.drain import DrainingServer

    built, seen = [], []
    monkeypatch.setattr(DrainingServer, "run", lambda self, sockets=None: built.append(self))
    add = Engine.add_request

    def spy(self, prompt=None, params=None, request_id=None, **kw):
        seen.append(params)
        return add(self, prompt, params, request_id, **kw)

    monkeypatch.setattr(Engine, "add_request", spy)
    return built, seen


BASE = ["--device", "cpu", "--port", "0", "--num-blocks", "40"]


def test_serve_applies_the_models_generation_defaults_to_unset_fields(checkpoint, served, capsys):
    from starlette.testclient import TestClient

    from kiln.cli import main

    built, seen = served
    assert main(["serve", str(checkpoint), *BASE]) == 0
    err = capsys.readouterr().err
    assert f"default sampling parameters from {checkpoint / 'generation_config.json'}" in err
    assert "temperature=0.6" in err and "max_tokens=7" in err and "a request's own values win" in err
    with TestClient(built[0].config.app) as c:  # the lifespan starts the engine loop
        # completions' max_tokens: the model's default for an explicit null; omitted, it is 16, as in vLLM
        r = c.post("/v1/completions", json={"prompt": [5, 9, 44], "ignore_eos": True, "max_tokens": None})
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 7, r.text
        p = seen[-1]
        assert (p.temperature, p.top_p, p.top_k, p.min_p, p.repetition_penalty, p.max_tokens) == \
            (0.6, 0.9, 20, 0.05, 1.1, 7)
        r = c.post("/v1/completions", json={"prompt": [5, 9, 44], "ignore_eos": True})
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 16, r.text
        assert (seen[-1].temperature, seen[-1].max_tokens) == (0.6, 16)
        mine = {"temperature": 0, "top_p": 1.0, "top_k": -1, "min_p": 0.0, "repetition_penalty": 1.0,
                "max_tokens": 3}
        r = c.post("/v1/completions", json={"prompt": [5, 9, 44], "ignore_eos": True, **mine})
        p = seen[-1]
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 3
        assert (p.temperature, p.top_p, p.top_k, p.min_p, p.repetition_penalty) == (0, 1.0, 0, 0.0, 1.0)
        r = c.post("/v1/chat/completions", json={"messages": MSGS, "temperature": None, "ignore_eos": True})
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 7, r.text
        assert seen[-1].temperature == 0.6  # null: the default, which is the model's


def test_serve_generation_config_vllm_and_chat_template_and_human_max_model_len(checkpoint, served, capsys,
                                                                                tmp_path):
    from starlette.testclient import TestClient

    from kiln.cli import main

    built, seen = served
    tpl = tmp_path / "t.jinja"
    tpl.write_text("{% for m in messages %}[{{ m.role }}]{{ m.content }}{% endfor %}")
    assert main(["serve", str(checkpoint), *BASE, "--generation-config", "vllm", "--chat-template", str(tpl),
                 "--max-model-len", "0.05k"]) == 0
    err = capsys.readouterr().err
    assert "default sampling parameters" not in err and f"chat template: {tpl}" in err
    with TestClient(built[0].config.app) as c:
        assert c.get("/v1/models").json()["data"][0]["max_model_len"] == 50
        r = c.post("/tokenize", json={"messages": MSGS})  # the checkpoint's byte-level tokenizer: a byte a token
        assert r.json()["tokens"] == list(b"[user]w1 w2"), r.text
        r = c.post("/v1/completions", json={"prompt": [5, 9, 44]})
        assert r.status_code == 200 and seen[-1].temperature == 1.0 and seen[-1].max_tokens == 16
    with pytest.raises(SystemExit):
        main(["serve", str(checkpoint), *BASE, "--max-model-len", "1.5K"])
    assert "binary suffix" in capsys.readouterr().err
