"""The Python API: `from kiln import LLM, SamplingParams`, generate and generate_stream in vLLM's shape."""

from __future__ import annotations

import subprocess
import sys

import pytest

from kiln.errors import KilnError, RequestError
from kiln.reference import generate


@pytest.fixture(scope="module")
def llm():
    from kiln import LLM

    return LLM("tiny-llama", device="cpu", seed=0, use_kernels=False)


def test_import_kiln_stays_light_and_exports_the_api():
    code = ("import sys, kiln; assert 'torch' not in sys.modules, 'import kiln pulled in torch'; "
            "from kiln import LLM, SamplingParams; assert LLM.__name__ == 'LLM' and SamplingParams().max_tokens")
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr


def test_generate_text_prompts_in_order_matching_the_reference(llm):
    from kiln import SamplingParams
    from kiln.build import load_model

    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    prompts = ["Hello", "Once upon a time", "x"]
    outs = llm.generate(prompts, params)
    ref_gm = load_model("tiny-llama", device="cpu", seed=0).gm
    assert [o.prompt for o in outs] == prompts
    for o, p in zip(outs, prompts, strict=True):
        want = generate(ref_gm, list(p.encode()), params, context=256).token_ids
        assert o.outputs[0].token_ids == want and o.finished and o.outputs[0].finish_reason == "length"
        assert o.prompt_token_ids == list(p.encode()) and o.outputs[0].text == llm.tokenizer.decode(want)
        assert o.metrics.ttft_s is not None and o.metrics.ttft_s >= 0


def test_generate_token_ids_and_per_prompt_params(llm):
    from kiln import SamplingParams

    outs = llm.generate(prompt_token_ids=[[1, 2, 3], [4, 5]],
                        sampling_params=[SamplingParams(temperature=0, max_tokens=2),
                                         SamplingParams(temperature=0, max_tokens=5, ignore_eos=True)])
    assert [len(o.outputs[0].token_ids) for o in outs] == [2, 5]
    single = llm.generate(prompt_token_ids=[1, 2, 3], sampling_params=SamplingParams(temperature=0, max_tokens=2))
    assert single[0].outputs[0].token_ids == outs[0].outputs[0].token_ids


def test_generate_stream_yields_deltas_that_add_up(llm):
    from kiln import SamplingParams

    params = SamplingParams(temperature=0, max_tokens=7, ignore_eos=True)
    toks: dict[str, list[int]] = {}
    finals = {}
    for out in llm.generate_stream(["ab", "cd"], params):
        toks.setdefault(out.request_id, []).extend(out.outputs[0].delta_token_ids)
        if out.finished:
            finals[out.request_id] = out.outputs[0].token_ids
    assert len(finals) == 2 and all(toks[r] == finals[r] and len(finals[r]) == 7 for r in finals)
    again = [o.outputs[0].token_ids for o in llm.generate(["ab", "cd"], params)]
    assert sorted(again) == sorted(finals.values())


def test_generate_makes_only_final_outputs_and_streams_keep_their_kind(llm, monkeypatch):
    from kiln import SamplingParams
    from kiln.runtime.request import Request

    made: list[str] = []
    real = Request.make_output
    monkeypatch.setattr(Request, "make_output", lambda self, *a, **kw: made.append(self.request_id) or real(self, *a,
                                                                                                            **kw))
    params = SamplingParams(temperature=0, max_tokens=7, ignore_eos=True)  # cumulative, as given
    outs = llm.generate(["ab", "cd", "e"], params)
    assert sorted(made) == sorted(o.request_id for o in outs) and all(len(o.outputs[0].token_ids) == 7 for o in outs)
    assert params.output_kind == "cumulative"  # the caller's params are not changed
    made.clear()
    delta = [o.outputs[0] for o in llm.generate_stream("ab", SamplingParams(**{**vars(params),
                                                                                  "output_kind": "delta"}))]
    assert len(made) == len(delta) == 7
    assert all(c.token_ids == c.delta_token_ids and len(c.token_ids) == 1 for c in delta)
    assert [c.token_ids[0] for c in delta] == outs[0].outputs[0].token_ids


def test_closing_a_stream_early_aborts_its_requests(llm):
    from kiln import SamplingParams

    stream = llm.generate_stream("abc", SamplingParams(temperature=0, max_tokens=50, ignore_eos=True))
    next(stream)
    stream.close()
    assert not llm.engine.has_unfinished()
    assert llm.engine.block_manager.num_free_blocks == llm.engine.block_manager.num_usable_blocks


def test_bad_requests_raise_and_leave_nothing_queued(llm):
    from kiln import SamplingParams

    with pytest.raises(RequestError, match="temperature"):
        llm.generate(["a", "b"], SamplingParams(temperature=-1))
    with pytest.raises(RequestError, match="prompt 1: the prompt has 300 input tokens .* leaves no room"):
        llm.generate(["a", "b" * 300], SamplingParams(max_tokens=4))  # the second is beyond the context
    with pytest.raises(RequestError, match="sampling_params"):
        llm.generate(["a", "b"], [SamplingParams()])
    assert not llm.engine.has_unfinished()


def test_pool_too_small_is_refused_at_start_up():
    from kiln import LLM

    with pytest.raises(KilnError, match=r"raise num_blocks to at least 17, or lower max_model_len \(LLM\(num_blocks="):
        LLM("tiny-llama", device="cpu", num_blocks=8)


def _np():
    return pytest.importorskip("numpy")


# Python-API inputs: (description, generate kwargs builder, None if accepted else (exception, message fragment)).
INPUT_TABLE = [
    ("numpy int64 array", lambda: {"prompt_token_ids": _np().array([1, 2, 3])}, None),
    ("numpy int32 array", lambda: {"prompt_token_ids": _np().array([1, 2, 3], dtype=_np().int32)}, None),
    ("list of numpy ints", lambda: {"prompt_token_ids": [_np().int64(1), _np().int64(2), _np().int64(3)]}, None),
    ("1-D torch tensor", lambda: {"prompt_token_ids": __import__("torch").tensor([1, 2, 3])}, None),
    ("2-D numpy batch", lambda: {"prompt_token_ids": _np().array([[1, 2, 3], [1, 2, 3]])}, None),
    ("list of 1-D tensors", lambda: {"prompt_token_ids": [__import__("torch").tensor([1, 2, 3])]}, None),
    ("scalar stop_token_ids", lambda: {"prompt_token_ids": [1, 2, 3], "sampling_params": _params(stop_token_ids=499)},
     None),
    ("numpy stop_token_ids", lambda: {"prompt_token_ids": [1, 2, 3],
                                      "sampling_params": _params(stop_token_ids=_np().array([498, 499]))}, None),
    ("dict sampling_params", lambda: {"prompt_token_ids": [1, 2, 3],
                                      "sampling_params": {"temperature": 0, "max_tokens": 4, "ignore_eos": True}},
     None),
    ("list of dict sampling_params", lambda: {"prompts": ["a"], "sampling_params": [{"temperature": 0,
                                                                                     "max_tokens": 4}]}, None),
    ("numpy float temperature", lambda: {"prompt_token_ids": [1, 2, 3],
                                         "sampling_params": _params(temperature=_np().float32(0.0))}, None),
    ("temperature 1e-45 (greedy)", lambda: {"prompt_token_ids": [1, 2, 3],
                                            "sampling_params": _params(temperature=1e-45)}, None),
    ("dict with an unknown field", lambda: {"prompts": "a", "sampling_params": {"temprature": 0}},
     (RequestError, "unknown field(s) 'temprature'")),
    ("sampling_params of a wrong type", lambda: {"prompts": "a", "sampling_params": 0.5},
     (RequestError, "must be a SamplingParams, a dict")),
    ("seed 10**30", lambda: {"prompts": "a", "sampling_params": _params(seed=10**30)},
     (RequestError, "seed = 1000000000000000000000000000000")),
    ("negative seed", lambda: {"prompts": "a", "sampling_params": _params(seed=-1)}, (RequestError, "0 .. 2**64 - 1")),
    ("float stop_token_ids", lambda: {"prompts": "a", "sampling_params": _params(stop_token_ids=1.5)},
     (RequestError, "stop_token_ids = 1.5")),
    ("float numpy prompt", lambda: {"prompt_token_ids": _np().array([1.0, 2.0])},
     (RequestError, "sequence of integer token ids")),
    ("3-D array prompt", lambda: {"prompt_token_ids": _np().zeros((1, 1, 2), dtype=int)},
     (RequestError, "3 dimensions")),
    ("empty prompt_token_ids", lambda: {"prompt_token_ids": []}, (RequestError, "prompt_token_ids is empty")),
    ("integer as prompt_token_ids", lambda: {"prompt_token_ids": 5}, (RequestError, "not int")),
    ("token ids as prompts", lambda: {"prompts": [[1, 2, 3]]}, None),
    ("a number as a prompt", lambda: {"prompts": [5]}, (RequestError, "prompts is a list of ints")),
    ("a number as prompts", lambda: {"prompts": 5}, (RequestError, "or a list of those, not int")),
    ("out-of-range numpy id", lambda: {"prompt_token_ids": _np().array([1, 10**6])}, (RequestError, "out of range")),
    ("vLLM token prompt dict", lambda: {"prompts": {"prompt_token_ids": [1, 2, 3]}}, None),
    ("vLLM prompt dicts", lambda: {"prompts": [{"prompt": "a"}, {"prompt_token_ids": [1, 2, 3]}]}, None),
    ("dict with other keys", lambda: {"prompts": {"prompt": "a", "multi_modal_data": {}}},
     (RequestError, "keys ['multi_modal_data', 'prompt']")),
    ("text inside prompt_token_ids", lambda: {"prompt_token_ids": ["12"]}, (RequestError, "not str '12'")),
    ("bools as token ids", lambda: {"prompt_token_ids": [True, False]}, (RequestError, "a bool at position 0")),
    ("bytes as prompts", lambda: {"prompts": b"abc"}, (RequestError, "not bytes")),
    ("the bad prompt of a batch is named", lambda: {"prompts": ["a", "", "b"]}, (RequestError, "prompt 1: ")),
    ("a float id in a batch is named", lambda: {"prompt_token_ids": [[1, 2], [3.5]]},
     (RequestError, "prompt 1: prompt_token_ids must be a sequence of integer token ids (a list, a 1-D numpy "
      "array or 1-D integer tensor), not list (position 0 is float 3.5)")),
    ("a bad parameter of a batch is named by its prompt", lambda: {"prompts": ["a", "b", "c"], "sampling_params": [
        _params(), _params(top_k=-5), _params()]}, (RequestError, "prompt 1: sampling parameter top_k = -5")),
    ("a bad output_kind is named, not replaced", lambda: {"prompts": "a",
                                                          "sampling_params": _params(output_kind="bogus")},
     (RequestError, "output_kind = 'bogus'")),
]


def _params(**kw):
    from kiln import SamplingParams

    return SamplingParams(**{"temperature": 0, "max_tokens": 4, "ignore_eos": True, **kw})


@pytest.mark.parametrize(("kwargs", "expect"), [row[1:] for row in INPUT_TABLE], ids=[row[0] for row in INPUT_TABLE])
def test_python_api_inputs_are_accepted_or_named(llm, kwargs, expect):
    kw = kwargs()
    if expect is None:
        kw.setdefault("sampling_params", _params())
        outs = llm.generate(**kw)
        assert outs and all(o.finished and o.outputs[0].finish_reason in ("length", "stop") for o in outs)
        token_forms = ([[1, 2, 3]], {"prompt_token_ids": [1, 2, 3]})
        if "prompt_token_ids" in kw or kw["prompts"] in token_forms:  # any form of [1, 2, 3] gives its tokens
            ref = llm.generate(prompt_token_ids=[1, 2, 3], sampling_params=_params())[0].outputs[0].token_ids
            for o in outs:
                got = o.outputs[0].token_ids
                assert o.prompt_token_ids == [1, 2, 3] and got == ref[: len(got)] and got
    else:
        exc, fragment = expect
        with pytest.raises(exc) as err:
            llm.generate(**kw)
        assert fragment in str(err.value)
    assert not llm.engine.has_unfinished() and not llm._queues


def test_llm_takes_quantize_and_shows_a_progress_bar(capsys):
    from kiln import LLM, SamplingParams
    from kiln.build import load_model

    llm = LLM("tiny-llama", device="cpu", seed=0, quantize="int8", use_kernels=False)
    assert "linear_w8" in str(llm.loaded.gm.graph)
    params = SamplingParams(temperature=0, max_tokens=5, ignore_eos=True)
    outs = llm.generate(["Hello", "x"], params, use_tqdm=True)
    err = capsys.readouterr().err
    assert "kiln: generating" in err and "2/2" in err
    ref = load_model("tiny-llama", device="cpu", seed=0, quantize="int8").gm
    for o, p in zip(outs, ["Hello", "x"], strict=True):
        assert o.outputs[0].token_ids == generate(ref, list(p.encode()), params, context=256).token_ids


def test_a_bad_seed_is_refused_before_loading():
    from kiln import LLM

    for seed in (-1, 1.5, True, 2**64):
        with pytest.raises(KilnError, match="seed = .* is out of range; allowed: an integer 0 .. 2\\*\\*64 - 1"):
            LLM("tiny-llama", device="cpu", seed=seed)


def test_n_choices_are_one_output_per_prompt_following_the_seed_rule(llm):
    from kiln import SamplingParams

    params = SamplingParams(n=3, seed=11, temperature=1.0, max_tokens=8, ignore_eos=True)
    prompts = ["ab", "cd"]
    outs = llm.generate(prompts, params)
    assert len(outs) == 2 and len({o.request_id for o in outs}) == 2 and all(o.finished for o in outs)
    assert all([c.index for c in o.outputs] == [0, 1, 2] for o in outs)
    assert [[c.token_ids for c in o.outputs] for o in llm.generate(prompts, params)] == [
        [c.token_ids for c in o.outputs] for o in outs]  # reproducible
    for o, prompt in zip(outs, prompts, strict=True):
        assert o.prompt == prompt and len({tuple(c.token_ids) for c in o.outputs}) == 3
        for i, c in enumerate(o.outputs):  # choice i is the single request with seed + i
            one = llm.generate(prompt, SamplingParams(seed=11 + i, temperature=1.0, max_tokens=8, ignore_eos=True))
            assert (c.token_ids, c.text, c.finish_reason) == (one[0].outputs[0].token_ids, one[0].outputs[0].text,
                                                              "length")
    unseeded = llm.generate("ab", SamplingParams(n=3, temperature=1.0, max_tokens=8, ignore_eos=True))[0]
    assert len({tuple(c.token_ids) for c in unseeded.outputs}) > 1
    assert not llm.engine.has_unfinished() and not llm._queues


@pytest.mark.parametrize("kind", ["cumulative", "delta", "final_only"])
def test_generate_stream_with_n_indexes_each_choice(llm, kind):
    from kiln import SamplingParams

    params = SamplingParams(n=2, seed=5, temperature=1.0, max_tokens=6, ignore_eos=True)
    want = [c.token_ids for c in llm.generate("xy", params)[0].outputs]
    got: dict[int, list[int]] = {0: [], 1: []}
    outs = list(llm.generate_stream("xy", SamplingParams(**{**vars(params), "output_kind": kind})))
    assert len({o.request_id for o in outs}) == 1 and [o.finished for o in outs].count(True) == 1
    assert outs[-1].finished
    for o in outs:
        for c in o.outputs:
            got[c.index] += c.delta_token_ids
    assert [got[0], got[1]] == want
    if kind == "final_only":
        assert len(outs) == 1 and [c.index for c in outs[0].outputs] == [0, 1]
    else:
        assert len(outs) == 12 and all(len(o.outputs) == 1 for o in outs)


def test_penalties_and_logit_bias_through_the_api_match_the_reference(llm):
    from kiln import SamplingParams
    from kiln.build import load_model

    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True, presence_penalty=1.2,
                            frequency_penalty=0.7, repetition_penalty=1.1, logit_bias={65: 2.5, 66: -3.0})
    got = llm.generate("Hello", params)[0].outputs[0].token_ids
    ref_gm = load_model("tiny-llama", device="cpu", seed=0).gm
    assert got == generate(ref_gm, list(b"Hello"), params, context=256).token_ids
    plain = llm.generate("Hello", SamplingParams(temperature=0, max_tokens=16, ignore_eos=True))[0]
    assert got != plain.outputs[0].token_ids


class _Eos:
    """A tokenizer with other eos ids (everything else is the wrapped tokenizer's)."""

    def __init__(self, tokenizer, eos: tuple[int, ...]):
        self._tokenizer, self.eos_token_ids = tokenizer, eos

    def __getattr__(self, name):
        return getattr(self._tokenizer, name)


def test_min_tokens_with_eos_set_to_the_greedy_token(llm):
    import torch

    from kiln import SamplingParams
    from kiln.build import load_model
    from kiln.reference import forward_logits
    from kiln.runtime.engine import Engine

    greedy = llm.generate("Hello", SamplingParams(temperature=0, max_tokens=1))[0].outputs[0].token_ids[0]
    e = Engine(llm.step_model, _Eos(llm.tokenizer, (greedy,)), llm.loaded.model, num_blocks=64)

    def run(**kw):
        rid = e.add_request("Hello", SamplingParams(temperature=0, max_tokens=12, **kw))
        return {o.request_id: o for o in e.run()}[rid].outputs[0]

    first = run()
    assert first.token_ids == [greedy] and first.finish_reason == "stop" and first.stop_reason is None
    held = run(min_tokens=4)
    assert greedy not in held.token_ids[:4] and len(held.token_ids) > 4
    ref_gm = load_model("tiny-llama", device="cpu", seed=0).gm  # llm.loaded.gm became the step graph
    logits = forward_logits(ref_gm, torch.tensor([list(b"Hello")]))[0, -1]
    assert held.token_ids[0] == int(logits.topk(2).indices[1])  # the runner-up: eos is at -inf
    ref = generate(ref_gm, list(b"Hello"), SamplingParams(temperature=0, max_tokens=12, min_tokens=4), context=256,
                   eos_token_ids=(greedy,))
    assert held.token_ids == ref.token_ids
    stopped = run(min_tokens=4, stop_token_ids=[held.token_ids[1]], ignore_eos=True)  # a stop id is held back too
    assert held.token_ids[1] not in stopped.token_ids[:4]


def test_bad_new_parameters_of_a_batch_are_named_and_nothing_is_queued(llm):
    from kiln import SamplingParams

    with pytest.raises(RequestError, match="prompt 1: sampling parameter n = 0"):
        llm.generate(["a", "b"], [SamplingParams(n=2), SamplingParams(n=0)])
    with pytest.raises(RequestError, match="prompt 0: logit_bias token id 100000 is out of range"):
        llm.generate(["a", "b"], SamplingParams(n=2, logit_bias={100000: 1.0}))
    with pytest.raises(RequestError, match="presence_penalty = 3"):
        llm.generate("a", {"presence_penalty": 3})
    with pytest.raises(RequestError, match="prompt_logprobs = 21 is out of range; allowed: None"):
        llm.generate("a", {"prompt_logprobs": 21})
    with pytest.raises(RequestError, match=r"prompts is a list of ints: one prompt's token ids go in prompt_token_ids"):
        llm.generate([1, 2, 3])
    assert not llm.engine.has_unfinished() and not llm._queues


def test_logprobs_are_vllms_logprob_objects(llm):
    """vLLM's shape, so code written for it reads kiln's outputs unchanged: `lps[i][token_id].logprob`, `.rank` (1:
    the most likely; the tokens at least as likely) and `.decoded_token` (decode([id])), for the output tokens
    (n > 1 choices too) and the prompt tokens; the values are the raw distribution's, whatever the temperature."""
    import torch

    from kiln import Logprob, SamplingParams
    from kiln.build import load_model
    from kiln.runtime.logprob import top_logprobs

    ref_gm = load_model("tiny-llama", device="cpu", seed=0).gm
    prompt = "Once upon"
    out = llm.generate(prompt, SamplingParams(temperature=0.8, seed=4, max_tokens=5, ignore_eos=True, logprobs=3,
                                              prompt_logprobs=2, n=2))[0]
    ids = list(prompt.encode())
    assert out.prompt_logprobs[0] is None and len(out.prompt_logprobs) == len(ids)
    for comp in out.outputs:
        toks = ids + comp.token_ids
        with torch.no_grad():
            raw = generate_logits(ref_gm, toks).log_softmax(-1)
        for at, lp in zip(range(len(ids), len(toks)), comp.logprobs, strict=True):
            row, tok = raw[at - 1], toks[at]
            assert all(isinstance(v, Logprob) for v in lp.values())
            top = row.topk(3).indices.tolist()
            # vLLM v1's order: the sampled token first, then the top 3 by rank
            assert next(iter(lp)) == tok and [t for t, _ in top_logprobs(lp, 3)] == top
            assert [lp[t].rank for t in top] == [1, 2, 3]
            assert lp[tok].logprob == pytest.approx(float(row[tok]), abs=1e-4)
            assert lp[tok].rank == int((row >= row[tok]).sum())
            assert all(v.decoded_token == llm.tokenizer.decode([t]) for t, v in lp.items())
        assert comp.cumulative_logprob == pytest.approx(sum(lp[t].logprob for lp, t in
                                                            zip(comp.logprobs, comp.token_ids, strict=True)))
    for at, lp in enumerate(out.prompt_logprobs[1:], start=1):
        row, tok = raw[at - 1], ids[at]
        assert lp[tok].logprob == pytest.approx(float(row[tok]), abs=1e-4)
        assert lp[tok].rank == int((row >= row[tok]).sum()) and lp[tok].decoded_token == llm.tokenizer.decode([tok])


def generate_logits(gm, toks: list[int]):
    """The Level-1 graph's logits [len(toks), vocab] for one sequence."""
    import torch

    from kiln.reference import forward_logits

    return forward_logits(gm, torch.tensor([toks]))[0].float()
