"""kiln.LLM the way a vLLM user calls it: a checkpoint directory, a .gguf or model= as the model, a Hub id refused
with how to get the files, generation_config.json sampling defaults (generation_config "auto" / "vllm"), the seed
seeding unseeded sampling, get_tokenizer, chat templates given by the caller and their kwargs, the warning for
kiln's default template, truncate_prompt_tokens, use_tqdm on by default, and vLLM's dtype names."""

from __future__ import annotations

import json
import logging

import pytest
import torch

from kiln.errors import KilnError, RequestError
from kiln.runtime.sampling_params import SamplingParams
from tests.support.gguf_helper import write_tiny_gguf
from tests.support.hf_models import save_hf_model

GEN = {
    "temperature": 0.6,
    "top_p": 0.9,
    "top_k": 20,
    "min_p": 0.05,
    "repetition_penalty": 1.1,
    "max_new_tokens": 7,
    "do_sample": True,
    "eos_token_id": 2,
    "bos_token_id": 1,
}
DEFAULTS = {"temperature": 0.6, "top_p": 0.9, "top_k": 20, "min_p": 0.05, "repetition_penalty": 1.1, "max_tokens": 7}


def LLM(*args, **kw):  # noqa: N802 - kiln.LLM on CPU with the reference ops
    from kiln import LLM as _LLM

    return _LLM(*args, device="cpu", use_kernels=False, **kw)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    d = tmp_path_factory.mktemp("ckpt")
    save_hf_model("llama", d)
    (d / "generation_config.json").write_text(json.dumps(GEN))
    return d


@pytest.fixture(scope="module")
def llm():
    return LLM(model="tiny-llama", seed=0)


def spy_params(llm, monkeypatch) -> list[SamplingParams]:
    seen: list[SamplingParams] = []
    add = llm.engine.add_request

    def spy(*args, **kw):
        seen.append(kw.get("params", args[1] if len(args) > 1 else None))
        return add(*args, **kw)

    monkeypatch.setattr(llm.engine, "add_request", spy)
    return seen


# ---- naming the model -------------------------------------------------------------------------------------------


def test_a_checkpoint_dir_as_the_model_is_its_weights(checkpoint, capsys):
    by_dir, by_weights = LLM(str(checkpoint)), LLM(weights=str(checkpoint))
    assert by_dir.loaded.source == by_weights.loaded.source == str(checkpoint)
    params = SamplingParams(temperature=0, max_tokens=5, ignore_eos=True)
    ids = [5, 9, 44, 100, 7]
    assert (
        by_dir.generate(prompt_token_ids=ids, sampling_params=params, use_tqdm=False)[0].outputs[0].token_ids
        == by_weights.generate(prompt_token_ids=ids, sampling_params=params, use_tqdm=False)[0].outputs[0].token_ids
    )
    with pytest.raises(
        KilnError, match="is a checkpoint directory, and weights .* name weights too; give the checkpoint once"
    ):
        LLM(str(checkpoint), weights=str(checkpoint))


def test_a_gguf_as_the_model(tmp_path):
    path = tmp_path / "tiny.gguf"
    write_tiny_gguf(path, linear_type="F32")
    llm = LLM(str(path))
    assert llm.loaded.source == str(path) and llm.loaded.generation_defaults == {}
    out = llm.generate(
        prompt_token_ids=[1, 5, 6],
        sampling_params=SamplingParams(temperature=0, max_tokens=3, ignore_eos=True),
        use_tqdm=False,
    )
    assert len(out[0].outputs[0].token_ids) == 3
    with pytest.raises(KilnError, match=r"is a \.gguf file, and weights"):
        LLM(str(path), weights=str(path))


def test_a_hub_id_is_refused_saying_kiln_loads_local_files():
    from kiln.build import load_model

    with pytest.raises(
        KilnError,
        match="kiln loads local checkpoints only and downloads nothing; download it first "
        r"\(e\.g\. `huggingface-cli download meta-llama/Llama-3.2-1B --local-dir",
    ):
        load_model("meta-llama/Llama-3.2-1B", device="cpu")


def test_a_lone_weights_file_names_its_directory(tmp_path):
    from kiln.build import load_model

    (tmp_path / "model.safetensors").write_bytes(b"x")
    with pytest.raises(KilnError, match="is one weights file; give the checkpoint directory"):
        load_model(tmp_path / "model.safetensors", device="cpu")


# ---- generation_config.json -------------------------------------------------------------------------------------


def test_generation_config_defaults_are_read_and_used(checkpoint, monkeypatch, caplog):
    caplog.set_level(logging.INFO, logger="kiln.status")  # the note is a status line (kiln.progress.say)
    llm = LLM(str(checkpoint))
    assert llm.loaded.generation_defaults == DEFAULTS
    assert str(checkpoint / "generation_config.json") in caplog.text  # said, as vLLM warns
    params = llm.get_default_sampling_params()
    assert params == SamplingParams(**DEFAULTS)
    seen = spy_params(llm, monkeypatch)
    llm.generate(prompt_token_ids=[5, 9, 44], use_tqdm=False)
    llm.chat([{"role": "user", "content": "hi"}], use_tqdm=False)
    assert [dataclasses_fields(p) for p in seen] == [dataclasses_fields(SamplingParams(**DEFAULTS))] * 2
    given = SamplingParams(temperature=0, max_tokens=2)
    llm.generate(prompt_token_ids=[5, 9, 44], sampling_params=given, use_tqdm=False)
    assert seen[-1].temperature == 0 and seen[-1].max_tokens == 2  # given params are used as they are


def dataclasses_fields(p: SamplingParams) -> tuple:
    return (p.temperature, p.top_p, p.top_k, p.min_p, p.repetition_penalty, p.max_tokens)


def test_generation_config_vllm_keeps_kilns_defaults(checkpoint, caplog):
    caplog.set_level(logging.INFO, logger="kiln.status")  # where the note would be (kiln.progress.say)
    llm = LLM(str(checkpoint), generation_config="vllm")
    assert llm.loaded.generation_defaults == {} and llm.get_default_sampling_params() == SamplingParams()
    assert "generation_config.json" not in caplog.text  # captured when said (the test above)


def test_generation_config_from_a_directory_and_bad_values(tmp_path, checkpoint):
    from kiln.build import load_model, read_generation_defaults

    other = tmp_path / "gen"
    other.mkdir()
    (other / "generation_config.json").write_text(json.dumps({"temperature": 0.3, "top_k": None}))
    assert load_model("tiny-llama", device="cpu", generation_config=other).generation_defaults == {"temperature": 0.3}
    assert load_model("tiny-llama", device="cpu").generation_defaults == {}  # random weights: no checkpoint
    with pytest.raises(KilnError, match="not 'auto' or 'vllm', nor a directory holding a generation_config.json"):
        load_model("tiny-llama", device="cpu", generation_config="greedy")
    (other / "generation_config.json").write_text(json.dumps({"top_p": 0}))
    with pytest.raises(
        KilnError,
        match=r"generation_config.json: sampling parameter top_p = 0 is out of range.*"
        "generation_config='vllm'",
    ):
        read_generation_defaults(other)
    (other / "generation_config.json").write_text("{")
    with pytest.raises(KilnError, match="not valid JSON"):
        read_generation_defaults(other)


# ---- seed, tokenizer, outputs -----------------------------------------------------------------------------------


def unseeded(llm) -> list[list[int]]:
    outs = llm.generate(["abc", "xyz"], SamplingParams(temperature=1.0, max_tokens=8, ignore_eos=True), use_tqdm=False)
    return [o.outputs[0].token_ids for o in outs]


def test_the_seed_seeds_unseeded_sampling():
    torch.manual_seed(1234)
    a = unseeded(LLM("tiny-llama", seed=5))
    torch.rand(7)  # whatever ran before does not matter
    b = unseeded(LLM("tiny-llama", seed=5))
    c = unseeded(LLM("tiny-llama", seed=6))
    assert a == b and a != c


def test_get_tokenizer_and_num_cached_tokens(llm):
    # tiny-llama has random weights and no tokenizer.json: vLLM has no tokenizer there, kiln's byte-level one is
    # llm.tokenizer (tests/hf/test_parity_tokenizer.py: get_tokenizer() of a checkpoint)
    with pytest.raises(KilnError, match=r"no tokenizer\.json.*use llm\.tokenizer"):
        llm.get_tokenizer()
    prompt = "a prompt long enough to fill two blocks of sixteen tokens"
    params = SamplingParams(temperature=0, max_tokens=2)
    first = llm.generate(prompt, params, use_tqdm=False)[0]
    second = llm.generate(prompt, params, use_tqdm=False)[0]
    assert first.num_cached_tokens == 0 and second.num_cached_tokens == 48 == second.metrics.num_cached_tokens


def test_truncate_prompt_tokens_keeps_the_last_tokens(llm):
    out = llm.generate(
        ["0123456789", {"prompt_token_ids": [1, 2, 3, 4, 5]}],
        SamplingParams(temperature=0, max_tokens=2, truncate_prompt_tokens=3),
        use_tqdm=False,
    )
    assert out[0].prompt == "0123456789" and out[0].prompt_token_ids == list(b"789")
    assert out[1].prompt_token_ids == [3, 4, 5]
    want = llm.generate(
        prompt_token_ids=list(b"789"), sampling_params=SamplingParams(temperature=0, max_tokens=2), use_tqdm=False
    )
    assert out[0].outputs[0].token_ids == want[0].outputs[0].token_ids
    short = [1, 2, 3]  # -1: the last max_model_len tokens, so a prompt that fits stays whole
    got = llm.generate(
        prompt_token_ids=short, sampling_params=SamplingParams(max_tokens=2, truncate_prompt_tokens=-1), use_tqdm=False
    )[0]
    assert got.prompt_token_ids == short
    long = list(range(1, 200)) * 2  # past the context of 256: kept to 256 tokens, which leave no room (as vLLM)
    with pytest.raises(RequestError, match="the prompt has 256 input tokens .* leaves no room to generate"):
        llm.generate(
            prompt_token_ids=long,
            sampling_params=SamplingParams(max_tokens=None, truncate_prompt_tokens=-1),
            use_tqdm=False,
        )
    with pytest.raises(RequestError, match="truncate_prompt_tokens = 0 is out of range"):
        llm.generate("x", SamplingParams(truncate_prompt_tokens=0), use_tqdm=False)


# ---- progress bar -----------------------------------------------------------------------------------------------


def test_use_tqdm_is_on_by_default_as_in_vllm(llm, capsys, monkeypatch):
    monkeypatch.delenv("TQDM_DISABLE", raising=False)
    llm.generate(["a", "b"], SamplingParams(max_tokens=1))
    assert "kiln: generating" in capsys.readouterr().err
    llm.generate(["a", "b"], SamplingParams(max_tokens=1), use_tqdm=False)
    assert "kiln: generating" not in capsys.readouterr().err
    monkeypatch.setenv("TQDM_DISABLE", "1")  # tqdm's own switch, which test runs and CI may set
    llm.chat([{"role": "user", "content": "x"}], SamplingParams(max_tokens=1))
    assert "kiln: generating" not in capsys.readouterr().err
    made = []

    class Bar:
        def __init__(self, **kw):
            made.append(kw)
            self.n = 0

        def update(self, k):
            self.n += k

        def close(self):
            made.append(self.n)

    llm.generate(["a", "b", "c"], SamplingParams(max_tokens=1), use_tqdm=Bar)  # vLLM takes a tqdm-like factory
    assert made[0]["total"] == 3 and made[-1] == 3


# ---- chat templates ---------------------------------------------------------------------------------------------

THINKING = (
    "{% for m in messages %}[{{ m.role }}]{{ m.content }}{% endfor %}"
    "{% if add_generation_prompt %}[assistant]{% if enable_thinking is defined and not enable_thinking %}"
    "<think></think>{% endif %}{% endif %}"
)


def test_chat_template_and_its_kwargs(llm, tmp_path):
    msgs = [{"role": "user", "content": "hi"}]
    assert llm.chat_prompts(msgs, chat_template=THINKING) == ["[user]hi[assistant]"]
    assert llm.chat_prompts(msgs, chat_template=THINKING, chat_template_kwargs={"enable_thinking": False}) == [
        "[user]hi[assistant]<think></think>"
    ]
    path = tmp_path / "t.jinja"
    path.write_text(THINKING)
    assert llm.chat_prompts(msgs, chat_template=str(path)) == ["[user]hi[assistant]"]
    out = llm.chat(
        msgs,
        SamplingParams(max_tokens=1),
        chat_template=THINKING,
        chat_template_kwargs={"enable_thinking": False},
        use_tqdm=False,
    )
    assert out[0].prompt == "[user]hi[assistant]<think></think>"
    with pytest.raises(RequestError, match="looks like a file path, but it cannot be opened"):
        llm.chat_prompts(msgs, chat_template="no/such/template.jinja")
    with pytest.raises(RequestError, match="chat_template_kwargs cannot set messages"):
        llm.chat_prompts(msgs, chat_template=THINKING, chat_template_kwargs={"messages": []})
    with pytest.raises(RequestError, match="chat_template_kwargs must be a dict"):
        llm.chat_prompts(msgs, chat_template_kwargs=["x"])


def test_kilns_default_template_is_said_once(llm, caplog, monkeypatch):
    import kiln.chat_template as ct

    monkeypatch.setattr(ct, "_default_noted", False)
    msgs = [{"role": "user", "content": "hi"}]
    with caplog.at_level(logging.WARNING, logger="kiln.chat_template"):
        assert llm.chat_prompts(msgs) == ["<|user|>\nhi\n<|assistant|>\n"]
        llm.chat_prompts(msgs)
        llm.chat_prompts(msgs, chat_template=THINKING)  # a given template: nothing to say
    said = [r.getMessage() for r in caplog.records if "no chat template" in r.getMessage()]
    assert len(said) == 1 and "kiln's default" in said[0] and "--chat-template" in said[0]


# ---- dtype names ------------------------------------------------------------------------------------------------


def test_vllms_dtype_names(checkpoint, tmp_path):
    from kiln.build import load_model

    assert load_model("tiny-llama", device="cpu", dtype="bfloat16").compile.dtype == "bf16"
    assert load_model("tiny-llama", device="cpu", dtype="half").compile.dtype == "fp16"
    assert load_model("tiny-llama", device="cpu", dtype=torch.float16).compile.dtype == "fp16"
    assert load_model("tiny-llama", device="cpu", dtype="auto").compile.dtype == "fp32"  # the spec's
    with pytest.raises(KilnError, match="dtype 'fp8' .* is not supported; choose one of fp32, fp16, bf16, or vLLM's"):
        load_model("tiny-llama", device="cpu", dtype="fp8")
    d = tmp_path / "bf16-ckpt"
    save_hf_model("llama", d)
    cfg = json.loads((d / "config.json").read_text())
    (d / "config.json").write_text(json.dumps({**cfg, "dtype": "bfloat16"}))
    assert load_model(d, device="cpu", dtype="auto").compile.dtype == "bf16"  # the checkpoint's own
    assert load_model(d, device="cpu").compile.dtype == "fp32"  # no dtype: kiln's default, as before


def test_a_default_max_tokens_past_the_context_stops_at_it(tmp_path):
    # generation_config.json's max_new_tokens is a default the user never chose: a prompt whose prompt + that
    # default passes the context runs to the context (vLLM stops there) instead of being refused
    gen = tmp_path / "gen"
    gen.mkdir()
    (gen / "generation_config.json").write_text(json.dumps({"max_new_tokens": 100000, "temperature": 0.0}))
    llm = LLM("tiny-llama", generation_config=str(gen))
    ctx = llm.engine.max_model_len
    out = llm.generate(prompt_token_ids=[[1, 2, 3], list(range(1, ctx - 1))], use_tqdm=False)
    assert [len(o.outputs[0].token_ids) for o in out] == [ctx - 3, 2]
    assert all(o.outputs[0].finish_reason == "length" for o in out)
    text = llm.generate("Hi", use_tqdm=False)[0]
    assert len(text.prompt_token_ids) + len(text.outputs[0].token_ids) == ctx
    # a max_tokens the user gave stops there too, as vLLM's engine stops it (its server refuses it)
    given = llm.generate(prompt_token_ids=[[1, 2, 3]], sampling_params=SamplingParams(max_tokens=100000, temperature=0),
                         use_tqdm=False)[0]
    assert len(given.outputs[0].token_ids) == ctx - 3 and given.outputs[0].finish_reason == "length"


def test_a_missing_spec_file_is_not_taken_for_a_hub_id():
    from kiln.build import resolve_model_paths

    assert resolve_model_paths("specs/missing.kiln", None) == ("specs/missing.kiln", None)
    with pytest.raises(KilnError, match="Hugging Face Hub id"):
        resolve_model_paths("meta-llama/Llama-3.2-1B", None)
