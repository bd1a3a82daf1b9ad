"""One encoding of a chat prompt everywhere: LLM.chat, `kiln run --chat` and the server's chat completions give the
rendered prompt the ids transformers' apply_chat_template(tokenize=True) gives, without the special tokens the
tokenizer adds (vLLM's add_special_tokens=False for chat: the template writes BOS itself), on a checkpoint whose
tokenizer adds a BOS and whose template writes none."""

from __future__ import annotations

import json

import pytest

from kiln.runtime.sampling_params import SamplingParams
from tests.support.hf_models import save_hf_model
from tests.support.served_llm import llm_engine, serve_llm
from tests.support.word_tokenizer import BOS, write_word_tokenizer

httpx = pytest.importorskip("httpx")

TEMPLATE = "{% for m in messages %}w3 {{ m.content }} {% endfor %}{% if add_generation_prompt %}w4{% endif %}"
MSGS = [{"role": "user", "content": "w1 w2"}]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """tiny Llama weights, the word tokenizer (its post-processor puts <s> first) and a template without BOS."""
    d = tmp_path_factory.mktemp("ckpt")
    save_hf_model("llama", d)
    write_word_tokenizer(d)
    (d / "tokenizer_config.json").write_text(json.dumps({"bos_token": "<s>", "chat_template": TEMPLATE}))
    return d


@pytest.fixture(scope="module")
def llm(checkpoint):
    from kiln import LLM

    return LLM(str(checkpoint), device="cpu", use_kernels=False)


def test_llm_chat_kiln_run_and_the_server_encode_the_chat_prompt_as_transformers(checkpoint, llm, capsys):
    transformers = pytest.importorskip("transformers")
    from kiln.cli import main

    hf = transformers.PreTrainedTokenizerFast(tokenizer_file=str(checkpoint / "tokenizer.json"), bos_token="<s>")
    want = hf.apply_chat_template(MSGS, chat_template=TEMPLATE, tokenize=True, add_generation_prompt=True)
    want = list(want["input_ids"] if hasattr(want, "keys") else want)
    assert want == [3, 1, 2, 4]
    (prompt,) = llm.chat_prompts(MSGS)
    assert llm.tokenizer.encode(prompt) == [BOS, *want]  # a plain prompt of the same text does get the BOS

    params = SamplingParams(temperature=0, max_tokens=2, ignore_eos=True)
    (out,) = llm.chat(MSGS, params, use_tqdm=False)
    assert out.prompt_token_ids == want and out.prompt == prompt

    with serve_llm(llm, engine=llm_engine(llm, num_blocks=32), model_name="tiny") as url:
        r = httpx.post(f"{url}/v1/chat/completions", json={"messages": MSGS, "max_tokens": 2, "temperature": 0,
                                                            "ignore_eos": True, "return_token_ids": True}, timeout=60)
    assert r.status_code == 200, r.text
    assert r.json()["prompt_token_ids"] == want
    assert r.json()["choices"][0]["token_ids"] == out.outputs[0].token_ids

    assert main(["run", "--weights", str(checkpoint), "--device", "cpu", "--chat", "--prompt", "w1 w2",
                 "--max-tokens", "1", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["prompt_token_ids"] == want
