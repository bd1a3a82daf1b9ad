"""One bad request never stops the engine: a request whose sampling or output handling fails, or whose logits
are not finite, ends alone with finish_reason "error"; the rest of the batch gets the same tokens as without it,
every block comes back, and the engine keeps serving. Runs on the fake step model (tests/fake_step.py)."""

from __future__ import annotations

import pytest
import torch

from kiln.runtime.batch_sampler import NONFINITE_LOGITS
from kiln.runtime.engine import Engine
from kiln.runtime.sampling_params import SamplingParams
from kiln.tokenizer import ByteTokenizer
from tests.support.engine_run import finish_all
from tests.support.fake_step import FakeStepModel, fake_config, fake_generate
from tests.support.faulty_parts import BoomDetokenizer, NaNStepModel

V = 97


def make_engine(model: FakeStepModel | None = None, **kw) -> Engine:
    kw.setdefault("block_size", 4)
    kw.setdefault("num_blocks", 64)
    return Engine(model or FakeStepModel(V), ByteTokenizer(V), fake_config(64), **kw)


def normal_requests() -> list[tuple[list[int], SamplingParams]]:
    """14 requests: greedy, seeded sampling, penalties and filters, so every sampler path runs beside the bad ones."""
    reqs = []
    for i in range(14):
        prompt = [(i * 7 + j) % 50 + 1 for j in range(3 + i % 5)]
        kind = i % 4
        if kind == 0:
            p = SamplingParams(temperature=0, max_tokens=6 + i % 3)
        elif kind == 1:
            p = SamplingParams(temperature=0.8, top_k=20, max_tokens=7, seed=i)
        elif kind == 2:
            p = SamplingParams(temperature=1.2, top_p=0.9, min_p=0.01, max_tokens=5, seed=100 + i)
        else:
            p = SamplingParams(temperature=0, repetition_penalty=1.3, max_tokens=8)
        reqs.append((prompt, p))
    return reqs


def assert_no_leak(eng: Engine) -> None:
    bm = eng.block_manager
    bm.check_invariants()
    assert bm.num_free_blocks == bm.num_usable_blocks and not any(bm.ref_counts) and not bm.tables


@pytest.mark.parametrize(
    "extreme",
    [
        SamplingParams(temperature=1e-45, max_tokens=6),
        SamplingParams(temperature=1e-300, seed=3, top_p=0.5, max_tokens=6),
        SamplingParams(temperature=1.0, repetition_penalty=1e-300, max_tokens=6, seed=1),
        SamplingParams(temperature=1e-45, repetition_penalty=1e300, min_p=0.5, max_tokens=6),
        SamplingParams(temperature=1e300, top_k=10**30, max_tokens=6, seed=2**64 - 1),
    ],
    ids=["temp-1e-45", "temp-1e-300", "penalty-1e-300", "penalty-1e300", "temp-1e300"],
)
def test_bad_requests_in_a_batch_of_16_leave_the_other_14_untouched(extreme):
    base = make_engine()
    ids = [base.add_request(prompt_token_ids=pr, params=p) for pr, p in normal_requests()]
    want = {rid: out.outputs[0].token_ids for rid, out in finish_all(base).items()}

    eng = make_engine()
    free_at_start = eng.block_manager.num_free_blocks
    mixed = [eng.add_request(prompt_token_ids=pr, params=p) for pr, p in normal_requests()[:7]]
    bad_params = eng.add_request(prompt_token_ids=[5, 6, 7], params=extreme)
    boom = eng.add_request(prompt_token_ids=[8, 9, 10, 11], params=SamplingParams(temperature=0, max_tokens=8))
    eng.requests[boom].detokenizer = BoomDetokenizer(eng.tokenizer)
    mixed += [eng.add_request(prompt_token_ids=pr, params=p) for pr, p in normal_requests()[7:]]
    final = finish_all(eng)

    assert [final[r].outputs[0].token_ids for r in mixed] == [want[r] for r in ids]
    assert all(final[r].outputs[0].finish_reason == "length" and final[r].error is None for r in mixed)
    # Extreme but valid parameters are served, not failed: tiny temperatures are greedy, penalties clamp.
    ext = final[bad_params].outputs[0]
    assert ext.finish_reason == "length" and len(ext.token_ids) == 6 and all(0 <= t < V for t in ext.token_ids)
    if extreme.temperature < 1e-5 and extreme.repetition_penalty == 1.0:
        assert ext.token_ids == fake_generate([5, 6, 7], 6, V)
    out = final[boom]
    assert out.outputs[0].finish_reason == "error" and out.finished
    assert "emitting its output failed" in out.error and "UnicodeDecodeError" in out.error and repr(boom) in out.error
    assert out.outputs[0].token_ids == fake_generate([8, 9, 10, 11], 2, V)  # the failing token was rolled back
    assert not eng.abort(boom)  # already finished: abort is a quiet no-op
    assert eng.block_manager.num_free_blocks == free_at_start
    assert_no_leak(eng)

    # Still serving.
    again = eng.add_request(prompt_token_ids=[1, 2, 3], params=SamplingParams(temperature=0, max_tokens=5))
    assert finish_all(eng)[again].outputs[0].token_ids == fake_generate([1, 2, 3], 5, V)
    assert_no_leak(eng)


def test_a_sampler_exception_ends_only_that_request():
    eng = make_engine()
    good = eng.add_request(prompt_token_ids=[1, 2], params=SamplingParams(temperature=0, max_tokens=4))
    bad = eng.add_request(prompt_token_ids=[3, 4], params=SamplingParams(temperature=0.7, max_tokens=4, seed=1))
    eng.requests[bad].generator = "not a generator"  # torch.multinomial raises TypeError for this row only
    final = finish_all(eng)
    assert final[good].outputs[0].token_ids == fake_generate([1, 2], 4, V)
    out = final[bad]
    assert out.outputs[0].finish_reason == "error" and out.outputs[0].token_ids == []
    assert "sampling failed" in out.error and "TypeError" in out.error
    assert_no_leak(eng)


def test_abort_of_a_request_whose_detokenizer_raises_does_not_raise():
    eng = make_engine()
    rid = eng.add_request(prompt_token_ids=[1, 2], params=SamplingParams(temperature=0, max_tokens=10))
    det = BoomDetokenizer(eng.tokenizer)
    det.visible_text = lambda final: (_ for _ in ()).throw(RuntimeError("text boom"))  # every read fails
    eng.requests[rid].detokenizer = det
    outs = eng.step()  # its first token: emitting fails, so it ends with an error at once
    assert [o.outputs[0].finish_reason for o in outs] == ["error"] and "text boom" in outs[0].error
    rid2 = eng.add_request(prompt_token_ids=[3, 4], params=SamplingParams(temperature=0, max_tokens=10))
    eng.requests[rid2].detokenizer = det
    assert eng.abort(rid2)  # flush and visible_text raise; abort still succeeds
    (out,) = eng.step()
    assert out.request_id == rid2 and out.outputs[0].finish_reason == "abort" and "flush boom" in out.error
    assert not eng.has_unfinished()
    assert_no_leak(eng)


def test_nan_logits_end_that_request_with_an_error_naming_the_cause():
    poison = 13
    eng = make_engine(NaNStepModel(poison))
    good = eng.add_request(prompt_token_ids=[1, 2, 3], params=SamplingParams(temperature=0, max_tokens=6))
    greedy_bad = eng.add_request(prompt_token_ids=[4, poison], params=SamplingParams(temperature=0, max_tokens=6))
    sampled_bad = eng.add_request(prompt_token_ids=[5, poison],
                                  params=SamplingParams(temperature=0.9, max_tokens=6, seed=0))
    final = finish_all(eng)
    assert final[good].outputs[0].token_ids == fake_generate([1, 2, 3], 6, V)
    for rid in (greedy_bad, sampled_bad):
        out = final[rid]
        assert out.outputs[0].finish_reason == "error" and out.outputs[0].token_ids == []
        assert NONFINITE_LOGITS in out.error and "eps" in out.error and "rope theta" in out.error
    # The poisoned prompt's blocks were not offered to the prefix cache, and nothing leaked.
    assert_no_leak(eng)
    again = eng.add_request(prompt_token_ids=[1, 2, 3, 4], params=SamplingParams(temperature=0, max_tokens=3))
    assert finish_all(eng)[again].outputs[0].token_ids == fake_generate([1, 2, 3, 4], 3, V)


def test_nan_weights_in_the_tiny_spec_end_requests_with_an_error():
    from kiln.build import load_model
    from kiln.compile.step import compile_step

    m = load_model("tiny-llama", device="cpu", seed=0)
    with torch.no_grad():
        for p in m.gm.parameters():
            p.fill_(float("nan"))
        for b in m.gm.buffers():
            if b.is_floating_point():
                b.fill_(float("nan"))
    step = compile_step(m.gm, m.model, m.compile, device=m.device, use_kernels=False)
    eng = Engine(step, m.tokenizer, m.model, num_blocks=20, block_size=16)
    rid = eng.add_request("Hi", SamplingParams(temperature=0, max_tokens=4))
    final = finish_all(eng)
    assert final[rid].outputs[0].finish_reason == "error" and NONFINITE_LOGITS in final[rid].error
    assert_no_leak(eng)


@pytest.mark.parametrize("phase", ["launch", "copy"])
def test_a_sampler_crash_for_the_whole_batch_fails_that_batch_and_the_engine_goes_on(monkeypatch, phase):
    """Whether the sampler's tensor work raises or its host copy does (a device fault shows up there)."""
    import kiln.runtime.batch_sampler as sampler_mod
    import kiln.runtime.plain_rows as plain_rows_mod

    eng = make_engine()
    a = eng.add_request(prompt_token_ids=[1, 2], params=SamplingParams(temperature=0, max_tokens=4))
    b = eng.add_request(prompt_token_ids=[3, 4, 5], params=SamplingParams(temperature=0, max_tokens=4))
    kaput = lambda *a, **k: (_ for _ in ()).throw(RuntimeError("kaput"))  # noqa: E731
    if phase == "launch":
        monkeypatch.setattr(plain_rows_mod, "launch_batch", kaput)
    else:
        monkeypatch.setattr(sampler_mod.LaunchedSample, "result", kaput)
    outs = eng.step()
    assert {o.request_id for o in outs} == {a, b}
    assert all(o.outputs[0].finish_reason == "error" and "kaput" in o.error for o in outs)
    assert all("sampling the batch failed" in o.error for o in outs)
    assert_no_leak(eng)
    monkeypatch.undo()
    c = eng.add_request(prompt_token_ids=[1, 2], params=SamplingParams(temperature=0, max_tokens=4))
    assert finish_all(eng)[c].outputs[0].token_ids == fake_generate([1, 2], 4, V)


def test_kiln_run_reports_nan_logits_as_one_message(monkeypatch, capsys):
    """As with NaN weights: `kiln run` exits 2 with the engine's reason instead of printing token 0 forever."""
    from kiln.cli import main
    from kiln.runtime.model_runner import ModelRunner

    real = ModelRunner.execute

    def nan_execute(self, sched, prompt=None):
        logits, sampled = real(self, sched, prompt=prompt)
        return torch.full_like(logits, float("nan")), sampled

    monkeypatch.setattr(ModelRunner, "execute", nan_execute)
    code = main(["run", "tiny-llama", "--prompt-ids", "1,2,3", "--max-tokens", "3", "--temperature", "0",
                 "--device", "cpu", "--json"])
    out, err = capsys.readouterr()
    assert code == 2 and out == "" and "NaN or inf logits" in err and "eps" in err and "Traceback" not in err
    assert err.count("NaN or inf logits") == 1 and "generation stopped after 0 token(s)" in err
