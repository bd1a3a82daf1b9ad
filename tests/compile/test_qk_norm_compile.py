"""A model with q/k norms (attention(qk_norm = rms), tiny-qwen3) through every pass and the generated kernels, and
through the paged engine: the same logits as its Level-1 graph, the same greedy tokens as the uncached reference."""

from __future__ import annotations

import copy
import dataclasses

import pytest
import torch

from kiln.build import load_model
from kiln.compile.driver import compile_model
from kiln.compile.step import compile_step
from kiln.ir.frontend import build_graph, random_weights
from kiln.model_config import ModConfig
from kiln.reference import generate
from kiln.runtime.engine import Engine
from kiln.runtime.sampling_params import SamplingParams
from kiln.spec.loader import load_spec
from tests.support.hf_models import prompts

SPEC = "tiny-qwen3"
GREEDY = dict(temperature=0, ignore_eos=True)
# The model pipeline (mod_routing for the routed variant), then each pass switched off in turn (rope_fusion requires
# gqa_fusion, so both go together).
OFF = {"full": (), "no gqa_fusion": ("gqa_fusion", "rope_fusion"), "no rope_fusion": ("rope_fusion",),
       "no norm_fusion": ("norm_fusion",), "no flash_tiling": ("flash_tiling",)}


def _qk_weights(cfg, seed: int = 0) -> dict[str, torch.Tensor]:
    """Random weights with q_norm / k_norm weights that are not all ones, so a misplaced one shows."""
    weights = random_weights(cfg, seed=seed)
    g = torch.Generator().manual_seed(seed + 1)
    for name, w in weights.items():
        if name.endswith((".q_norm.weight", ".k_norm.weight")):
            weights[name] = w + 0.3 * torch.randn(w.shape, generator=g)
    return weights


def _close(got: torch.Tensor, want: torch.Tensor) -> bool:
    return (got - want).abs().max().item() < 1e-4 * want.abs().max().item()


@pytest.mark.parametrize("routed", [False, True], ids=["dense", "routed"])
@pytest.mark.parametrize("off", list(OFF))
def test_every_pass_composes_with_qk_norm_on_the_kernels(off, routed):
    loaded = load_spec(SPEC)
    cfg, comp = loaded.model, loaded.compile
    if routed:  # Mixture-of-Depths: the q/k norms run in the compact body of layer 1
        cfg = dataclasses.replace(cfg, route=ModConfig(0.5, 2))
        comp = dataclasses.replace(comp, extra={**comp.extra, "route": cfg.route})
    weights = _qk_weights(cfg)
    tokens, positions = prompts(cfg.vocab, batch=2, length=11), torch.arange(11).expand(2, 11).contiguous()
    with torch.no_grad():
        want = build_graph(cfg, weights)(tokens, positions)
        compiled = compile_model(build_graph(cfg, weights), comp, use_kernels=True,
                                 overrides=dict.fromkeys(OFF[off], False))
        got = compiled(tokens, positions)
    expected = ["mod_routing"] * routed + [p for p in ("gqa_fusion", "rope_fusion", "norm_fusion", "flash_tiling")
                                           if p not in OFF[off]]
    assert compiled.passes == expected
    launched = {r.params.get("op") for r in compiled.kernels}
    # With rope_fusion the q/k norms run in the rope kernel (kiln::qk_norm_rope: norms and ropes in one launch),
    # else on the norm kernel, one program per row and head.
    fused = "rope_fusion" in expected
    assert ("qk_norm_rope" in launched) == fused and ("head_rms_norm" in launched) != fused
    assert _close(got, want), (got - want).abs().max()


@pytest.fixture(scope="module")
def served():
    """tiny-qwen3 (perturbed q/k norm weights): its Level-1 graph and the loaded model, ready for compile_step."""
    m = load_model(SPEC, device="cpu", seed=0)
    with torch.no_grad():
        for name, p in m.gm.named_parameters():
            if name.endswith((".q_norm.weight", ".k_norm.weight")):
                p.mul_(torch.linspace(0.6, 1.4, p.shape[0]))
    return m, copy.deepcopy(m.gm)  # compile_step rewrites m.gm in place


def _trace(n: int, seed: int = 1) -> list[tuple[list[int], int]]:
    g = torch.Generator().manual_seed(seed)
    return [(torch.randint(3, 512, (int(torch.randint(1, 40, (1,), generator=g)),), generator=g).tolist(),
             int(torch.randint(1, 10, (1,), generator=g))) for _ in range(n)]


def _engine_tokens(engine: Engine, trace) -> list[list[int]]:
    ids = [engine.add_request(prompt_token_ids=p, params=SamplingParams(max_tokens=n, **GREEDY)) for p, n in trace]
    done = {o.request_id: o.outputs[0].token_ids for o in engine.run()}
    return [done[i] for i in ids]


@pytest.mark.parametrize("use_kernels", [False, True], ids=["reference ops", "kernels"])
def test_paged_engine_greedy_tokens_equal_the_uncached_reference(served, use_kernels):
    m, ref_gm = served
    # The interpreter is slow: a few short requests there, a continuous batch with chunked prefill on the references.
    trace = _trace(3 if use_kernels else 12)
    if use_kernels:
        trace = [(p[:12], min(n, 3)) for p, n in trace]
    want = [generate(ref_gm, p, SamplingParams(max_tokens=n, **GREEDY), context=m.model.context).token_ids
            for p, n in trace]
    assert len({t for w in want for t in w}) >= 3, "the reference's tokens are too repetitive to compare"
    gm = copy.deepcopy(ref_gm)
    step = compile_step(gm, m.model, m.compile, device="cpu", use_kernels=use_kernels)
    engine = Engine(step, m.tokenizer, m.model, max_num_seqs=8, max_num_batched_tokens=32)
    assert _engine_tokens(engine, trace) == want


def test_llm_generates_the_reference_tokens():
    from kiln.llm import LLM

    llm = LLM(SPEC, device="cpu", seed=0)
    ref = load_model(SPEC, device="cpu", seed=0).gm
    trace = _trace(4, seed=2)
    outs = llm.generate(prompt_token_ids=[p for p, _ in trace],
                        sampling_params=[SamplingParams(max_tokens=n, **GREEDY) for _, n in trace])
    want = [generate(ref, p, SamplingParams(max_tokens=n, **GREEDY), context=256).token_ids for p, n in trace]
    assert [o.outputs[0].token_ids for o in outs] == want
