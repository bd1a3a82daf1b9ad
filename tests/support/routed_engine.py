"""Helpers for routed (Mixture-of-Depths) engine tests: the reference's routing decisions, a mixed request trace, a
driver that records each request's routed lengths, and the no-leak check over the dense and routed pools."""

from __future__ import annotations

import random

import torch
from torch import fx

from kiln.runtime.engine import Engine
from kiln.runtime.routed_blocks import RoutedBlockManager
from kiln.runtime.sampling_params import SamplingParams

GREEDY = dict(temperature=0, ignore_eos=True)


BLOCK, CONTEXT, MARGIN = 8, 64, 1e-4


class RoutingDecisions(fx.Interpreter):
    """Runs a Level-1 graph and keeps each routed layer's score and threshold (kiln::mod_threshold_mask's inputs)."""

    def __init__(self, gm: fx.GraphModule):
        super().__init__(gm)
        self.seen: list[tuple[torch.Tensor, float]] = []

    def run_node(self, n: fx.Node):
        out = super().run_node(n)
        if n.target is torch.ops.kiln.mod_threshold_mask.default:
            score, threshold = self.map_nodes_to_values(n.args, n)
            self.seen.append((score[0].float(), float(threshold) if threshold is not None else 0.0))
        return out


def reference_routing(gm: fx.GraphModule, tokens: list[int]) -> tuple[list[int], float]:
    """(tokens routed per routed layer, the smallest |score - threshold|) over `tokens` at positions 0..T-1."""
    interp = RoutingDecisions(gm)
    t = torch.tensor([tokens])
    with torch.inference_mode():
        interp.run(t, torch.arange(len(tokens))[None])
    counts = [int((score > thr).sum()) for score, thr in interp.seen]
    margin = min(float((score - thr).abs().min()) for score, thr in interp.seen)
    return counts, margin


def make_trace(seed: int = 1, n: int = 32) -> list[tuple[list[int], int]]:
    rng = random.Random(seed)
    shared = [rng.randrange(512) for _ in range(20)]
    trace = []
    for i in range(n):
        own = [rng.randrange(512) for _ in range(rng.randint(1, 25))]
        prompt = shared + own if i % 3 == 0 else own + [rng.randrange(512) for _ in range(rng.randint(0, 20))]
        trace.append((prompt, rng.randint(1, 10)))
    return trace


def run_engine(engine: Engine, trace, check: bool = True) -> tuple[list[list[int]], dict[str, list[int]], int]:
    """Token ids in trace order, each request's routed lengths when its blocks were last freed, most running.
    check: the block manager's invariants after every step() call (they record any pending routing first)."""
    bm = engine.block_manager
    assert isinstance(bm, RoutedBlockManager)
    final: dict[str, list[int]] = {}
    bm.on_free.append(lambda rid: final.__setitem__(rid, list(bm.routed_lens.get(rid, ()))))
    ids = [engine.add_request(prompt_token_ids=p, params=SamplingParams(max_tokens=n, **GREEDY)) for p, n in trace]
    done, most = {}, 0
    while engine.has_unfinished():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out.outputs[0].token_ids
        most = max(most, len(engine.scheduler.running))
        if check:
            bm.check_invariants()
    return [done[i] for i in ids], {i: final[i] for i in ids}, most


def check_no_leaks(bm: RoutedBlockManager) -> None:
    bm.check_invariants()
    assert not bm.tables and all(rid.startswith("\0prefix:") for g in bm.routed for rid in g.tables)
    bm.reset_prefix_cache()  # drops the prefix entries' references on routed blocks
    bm.check_invariants()
    for g in (bm, *bm.routed):
        assert g.num_free_blocks == g.num_usable_blocks and not any(g.ref_counts) and not g.tables
    assert not bm.routed_lens and not bm.known


SPECS = ("tiny-llama-mod", "tiny-mistral-mod")
