"""Speculative-decoding helpers for runtime tests: a verifier on the reference op, and draft step models built
the way the compile pipeline will build them (a self drafter is the target's first L layers, same weights)."""

from __future__ import annotations

import copy
import dataclasses

import torch

import kiln.ir.ops_spec  # noqa: F401  (registers kiln::spec_verify)
from kiln.build import LoadedModel, load_model
from kiln.compile.step import CompiledStep, compile_step
from kiln.ir.frontend import build_graph
from kiln.model_config import param_shapes
from kiln.step import VerifyBatch


def reference_verify(b: VerifyBatch) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.ops.kiln.spec_verify(b.target_probs, b.draft_tokens, b.draft_probs, b.num_drafts, b.uniforms,
                                      b.noise)


@dataclasses.dataclass
class SpecModels:
    loaded: LoadedModel
    target: CompiledStep  # carries `verify` (the reference op)
    weights: dict[str, torch.Tensor]  # the target's Level-1 weights (before compile_step's fusions)
    reference: torch.fx.GraphModule  # the target's Level-1 graph (kiln.reference.forward_logits runs it)


def spec_models(spec: str = "tiny-llama", seed: int = 0, **overrides) -> SpecModels:
    """A target step model on the reference ops with a reference verifier; overrides replace ModelConfig fields
    (a smaller vocab, more layers) and the weights are seeded random."""
    m = load_model(spec, device="cpu", seed=seed)
    if overrides:
        cfg = dataclasses.replace(m.model, **overrides)
        m = dataclasses.replace(m, model=cfg, gm=build_graph(cfg, seed=seed))
    weights = {k: v.detach().clone() for k, v in m.gm.state_dict().items()}
    reference = copy.deepcopy(m.gm)  # compile_step rewrites its graph in place
    target = compile_step(m.gm, m.model, m.compile, device="cpu", use_kernels=False)
    target.verify = reference_verify
    return SpecModels(m, target, weights, reference)


def self_draft(sm: SpecModels, layers: int) -> CompiledStep:
    """The target's first `layers` layers with its final norm and head: the numbers the truncation pass gives."""
    cfg = dataclasses.replace(sm.loaded.model, layers=layers)
    gm = build_graph(cfg, {k: sm.weights[k] for k in param_shapes(cfg)})
    return compile_step(gm, cfg, sm.loaded.compile, device="cpu", use_kernels=False)


def other_draft(sm: SpecModels, seed: int, **overrides) -> CompiledStep:
    """A separate draft model: the target's config (same vocab) with overrides and other random weights."""
    cfg = dataclasses.replace(sm.loaded.model, **overrides)
    return compile_step(build_graph(cfg, seed=seed), cfg, sm.loaded.compile, device="cpu", use_kernels=False)


def run_requests(engine, requests: list, each_step=None) -> list[list[int]]:
    """Add (prompt ids, SamplingParams) requests, step until all finish (calling each_step(engine) after every
    step), check that every block came back, and return each request's final token ids in order."""
    ids = [engine.add_request(prompt_token_ids=p, params=params) for p, params in requests]
    done = {}
    while engine.has_unfinished():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out.outputs[0].token_ids
        if each_step is not None:
            each_step(engine)
    bm = engine.block_manager
    bm.check_invariants()
    assert bm.num_free_blocks == bm.num_usable_blocks and not any(bm.ref_counts)
    return [done[i] for i in ids]
