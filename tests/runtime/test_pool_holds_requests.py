"""Every request an engine accepts fits its KV pool, so add_request needs no pool check of its own: max_tokens_for
makes prompt + max_tokens at most max_model_len, and choose_num_blocks refuses (PoolTooSmallError, when the engine
is made) a pool without room for one sequence of max_model_len tokens. If either rule weakens, these fail."""

from __future__ import annotations

import itertools

import pytest

from kiln.errors import RequestError
from kiln.runtime.engine import Engine
from kiln.runtime.kv_pool import PoolTooSmallError
from kiln.runtime.sampling_params import SamplingParams
from tests.support.fake_step import FakeStepModel, fake_config, fake_generate

V = 97


def _engine(context: int, block_size: int, num_blocks: int | None, max_model_len: int | None) -> Engine | None:
    try:
        return Engine(FakeStepModel(V), None, fake_config(context, V), block_size=block_size, num_blocks=num_blocks,
                      max_model_len=max_model_len)  # fmt: skip
    except PoolTooSmallError:
        return None


@pytest.mark.parametrize("block_size", [1, 4, 16])
def test_every_accepted_request_fits_the_pool(block_size):
    built = 0
    for context, num_blocks, max_model_len in itertools.product([7, 16, 17], [None, 2, 3, 5, 6, 18], [None, 5, 16]):
        if max_model_len is not None and max_model_len > context:
            continue
        e = _engine(context, block_size, num_blocks, max_model_len)
        limit = max_model_len or context
        if e is None:  # refused when made: fewer blocks than one max_model_len sequence and the null block
            assert num_blocks is not None and num_blocks < -(-limit // block_size) + 1
            continue
        built += 1
        bm = e.block_manager
        for prompt_len, max_tokens in itertools.product(range(1, context + 2), [None, 1, 3, 100]):
            try:
                rid = e.add_request(prompt_token_ids=[1] * prompt_len, params=SamplingParams(max_tokens=max_tokens))
            except RequestError as err:  # only a prompt that leaves no room, never the pool
                assert prompt_len >= limit and err.param == "prompt", err
                continue
            req = e.requests[rid]
            total = len(req.prompt_token_ids) + req.params.max_tokens
            assert total <= limit and bm.blocks_for(total) <= bm.num_usable_blocks, (context, num_blocks, total)
            e.abort(rid)
    assert built


def test_the_smallest_pool_allowed_runs_a_full_length_request():
    """num_blocks = one max_model_len sequence's blocks + the null block: a request of that length runs to its end."""
    e = _engine(19, 4, -(-19 // 4) + 1, None)
    assert e is not None and e.block_manager.num_usable_blocks == 5
    prompt = [3, 1, 4, 1, 5]
    e.add_request(prompt_token_ids=prompt, params=SamplingParams(temperature=0, max_tokens=None, ignore_eos=True))
    (out,) = e.run()
    assert out.outputs[0].token_ids == fake_generate(prompt, 19 - len(prompt), V)
    assert out.outputs[0].finish_reason == "length"
