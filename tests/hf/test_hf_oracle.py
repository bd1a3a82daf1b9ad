"""kiln against transformers: the same checkpoint must give the same logits and the same greedy tokens.

For each family a tiny random checkpoint is saved, imported with config_from_hf + load_hf_weights, built with
the frontend, and compared with the HF model (fp32, eager attention) on a batch of two prompts.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from kiln.hf.config import config_from_hf, load_hf_config
from kiln.hf.weights import load_hf_weights
from kiln.ir.frontend import build_graph
from kiln.model_config import AttentionCall, LayerAssign
from kiln.reference import forward_logits, generate
from kiln.runtime.sampling_params import SamplingParams
from kiln.tokenizer import eos_ids
from tests.support.hf_models import FAMILIES, MISTRAL_WINDOW, prompts, save_hf_model

PROMPT_LEN, NEW_TOKENS = 11, 12


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    """family -> (family, HF model, kiln graph, ModelConfig, checkpoint dir), built on first use."""
    cache: dict = {}

    def get(fam: str):
        if fam not in cache:
            d = tmp_path_factory.mktemp(fam)
            hf = save_hf_model(fam, d)
            cfg = config_from_hf(load_hf_config(d))
            cache[fam] = fam, hf, build_graph(cfg, load_hf_weights(d, cfg, model_type=fam)), cfg, d
        return cache[fam]

    return get


@pytest.fixture(params=FAMILIES)
def pair(request, built):
    return built(request.param)


def close(a: torch.Tensor, b: torch.Tensor) -> bool:
    return (a - b).abs().max().item() < 1e-4 * b.abs().max().item()


def test_logits_match(pair):
    _, hf, gm, cfg, _ = pair
    ids = prompts(cfg.vocab, batch=2, length=PROMPT_LEN)
    with torch.no_grad():
        want = hf(ids).logits
    got = forward_logits(gm, ids)
    assert got.shape == want.shape == (2, PROMPT_LEN, cfg.vocab)
    assert close(got, want), (got - want).abs().max()


def test_greedy_generation_matches(pair):
    _, hf, gm, cfg, d = pair
    eos = eos_ids(d)
    assert eos == (2,)
    for row in prompts(cfg.vocab, batch=2, length=PROMPT_LEN):
        with torch.no_grad():
            out = hf.generate(
                row[None], attention_mask=torch.ones_like(row[None]), do_sample=False, max_new_tokens=NEW_TOKENS
            )
        want = out[0, PROMPT_LEN:].tolist()
        assert len(set(want)) >= 3, f"HF greedy output too repetitive to be a useful oracle: {want}"
        got = generate(
            gm,
            row.tolist(),
            SamplingParams(temperature=0, max_tokens=NEW_TOKENS),
            context=cfg.context,
            eos_token_ids=eos,
        )
        assert got.token_ids == want


def test_mistral_window_is_applied_by_both(built):
    fam, hf, gm, cfg, d = built("mistral")
    # Two layers of window 4: the last position (10) sees positions >= 10 - 2 * 3 = 4, never position 0.
    ids = prompts(cfg.vocab, batch=1, length=PROMPT_LEN)
    far, near = ids.clone(), ids.clone()
    far[0, 0] = (far[0, 0] + 1) % cfg.vocab
    near[0, -2] = (near[0, -2] + 1) % cfg.vocab
    with torch.no_grad():
        base, hf_far, hf_near = (hf(x).logits[0, -1] for x in (ids, far, near))
    assert torch.equal(base, hf_far) and not torch.equal(base, hf_near)
    assert torch.equal(forward_logits(gm, ids)[0, -1], forward_logits(gm, far)[0, -1])
    # And the window matters: the same weights with full attention give other logits.
    full_body = tuple(_unwindowed(s) for s in cfg.body)
    assert sum(isinstance(s, AttentionCall) and s.window == MISTRAL_WINDOW for s in cfg.sites()) == 1
    full = dataclasses.replace(cfg, body=full_body)
    gm_full = build_graph(full, load_hf_weights(d, full, model_type=fam))
    assert not close(forward_logits(gm_full, ids), forward_logits(gm, ids))


def _unwindowed(stmt: LayerAssign) -> LayerAssign:
    right = stmt.value.right
    if isinstance(right, AttentionCall):
        right = dataclasses.replace(right, window=None)
    return dataclasses.replace(stmt, value=dataclasses.replace(stmt.value, right=right))
