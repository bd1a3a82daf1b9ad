"""One workload of bench/mod_speed.py on one model: a fresh engine with an explicit pool (the workload's blocks plus
a step of slack, the routed pools as large as the dense one), a warm-up run of the same step shapes, then the timed
run; its row is tokens/s, the routed fraction of each routed layer (counted by mod_twins.CountRouted), KV bytes per
token at those fractions and the KV bytes held when decoding started."""

from __future__ import annotations

import dataclasses
import time

import torch
from mod_twins import CountRouted

from kiln.compile.step import CompiledStep
from kiln.model_config import ModelConfig
from kiln.runtime.engine import Engine
from kiln.runtime.sampling_params import SamplingParams
from kiln.step import kv_bytes_per_layer_block


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def kv_bytes_per_token(step: CompiledStep, fractions: dict[str, float]) -> float:
    """Bytes of K/V one token leaves in the cache: every dense layer's, plus each routed layer's times its measured
    routed fraction."""
    layer = kv_bytes_per_layer_block(step, 1)
    return layer * (step.num_layers + sum(fractions.values()))


@dataclasses.dataclass
class Workload:
    prompts: int
    prompt_len: int
    new_tokens: int
    temperature: float
    max_batched: int
    prefix_caching: bool = False
    cuda_graphs: bool | None = None  # None: the engine's default (on for a CUDA model, routed or dense)
    async_scheduling: bool | None = None  # None: the engine's default (on for a CUDA model, routed or dense)


def _engine(step, cfg: ModelConfig, w: Workload, block_size: int) -> Engine:
    per_seq = -(-(w.prompt_len + w.new_tokens) // block_size)
    blocks = w.prompts * per_seq + -(-w.max_batched // block_size) + 2
    routed = blocks if getattr(step, "num_routed_layers", 0) else None
    return Engine(step, None, cfg, num_blocks=blocks, max_num_seqs=max(w.prompts, 1),
                  max_num_batched_tokens=w.max_batched, max_model_len=w.prompt_len + w.new_tokens,
                  routed_num_blocks=routed, enable_prefix_caching=w.prefix_caching, use_cuda_graphs=w.cuda_graphs,
                  async_scheduling=w.async_scheduling)


def _prompts(gen: torch.Generator, vocab: int, n: int, length: int) -> list[list[int]]:
    return torch.randint(0, vocab, (n, length), generator=gen).tolist()


def _run(engine: Engine, prompts: list[list[int]], w: Workload, on_all_started=None) -> tuple[float, dict]:
    """Run the requests to completion: (wall seconds, {"t0", "tokens_at_t0", "tokens"}) where t0 is when every
    request had its first token (on_all_started runs just before t0 is taken)."""
    params = SamplingParams(temperature=w.temperature, max_tokens=w.new_tokens, ignore_eos=True)
    start = time.perf_counter()
    for p in prompts:
        engine.add_request(prompt_token_ids=p, params=params)
    got: dict[str, int] = {}
    mark: dict = {}
    while engine.has_unfinished():
        for out in engine.step():
            got[out.request_id] = len(out.outputs[0].token_ids)
        if not mark and len(got) == len(prompts) and all(got.values()):
            if on_all_started is not None:
                mark["at_start"] = on_all_started()
            mark["t0"], mark["tokens_at_t0"] = time.perf_counter(), sum(got.values())
    _sync(engine.model.device)
    end = time.perf_counter()
    return end - start, {**mark, "end": end, "tokens": sum(got.values())}


def kv_in_use(engine: Engine) -> int:
    """Bytes of K/V blocks the engine's live requests hold now (dense pool + every routed pool)."""
    st, step = engine.stats, engine.model
    layer = kv_bytes_per_layer_block(step, engine.block_manager.block_size)
    return (st.num_blocks - st.num_free_blocks) * layer * step.num_layers + sum(st.routed_blocks_in_use) * layer


def measure(step: CountRouted, cfg: ModelConfig, w: Workload, seed: int, block_size: int,
            routed_layers: list[int]) -> dict:
    """One workload on a fresh engine: a warm-up run of the same shapes, then the timed run; the prompts depend on
    the seed alone, so every model of a workload gets the same ones."""
    engine = _engine(step, cfg, w, block_size)
    step.watch(engine.block_manager)
    gen = torch.Generator().manual_seed(seed)
    # Warm-up (kernel compiles, graph captures) on the timed run's step shapes: one full prefill step and a bit
    # more, or the whole decode batch for a few tokens.
    warm = dataclasses.replace(w, prompts=min(w.prompts, w.max_batched // w.prompt_len + 1),
                               new_tokens=min(w.new_tokens, 4))
    _run(engine, _prompts(gen, cfg.vocab, warm.prompts, w.prompt_len), warm)
    step.reset()
    before = engine.stats
    held = {}
    secs, mark = _run(engine, _prompts(gen, cfg.vocab, w.prompts, w.prompt_len), w,
                      on_all_started=lambda: held.setdefault("kv", kv_in_use(engine)))
    st = engine.stats
    row = {"wall_s": round(secs, 4), "steps": st.num_steps - before.num_steps,
           "preemptions": st.num_preemptions - before.num_preemptions,
           "kv_pool_bytes_allocated": engine.kv_bytes, "routed_fraction": step.fractions(routed_layers),
           "async_scheduling": engine.async_scheduling}
    if w.new_tokens == 1:
        row["tok_s"] = round(w.prompts * w.prompt_len / secs, 2)
    else:
        row["decode_s"] = round(mark["end"] - mark["t0"], 4)
        row["tok_s"] = round((mark["tokens"] - mark["tokens_at_t0"]) / (mark["end"] - mark["t0"]), 2)
        row["kv_bytes_at_decode_start"] = held["kv"]
    row["kv_bytes_per_token"] = round(kv_bytes_per_token(step, row["routed_fraction"]), 1)
    return row
