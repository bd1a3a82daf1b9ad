"""The Python API: a spec (and optionally a checkpoint) in, batched generation out, in vLLM's shape.

    from kiln import LLM, SamplingParams
    llm = LLM("tiny-llama")
    outs = llm.generate(["Hello", "Once upon"], SamplingParams(temperature=0, max_tokens=16))
    print(outs[0].outputs[0].text)
"""

from __future__ import annotations

import os
from collections.abc import Iterator, Sequence

from kiln.errors import KilnError, RequestError
from kiln.runtime.engine import Engine
from kiln.runtime.request import RequestOutput
from kiln.runtime.sampler import SamplingParams


class LLM:
    def __init__(
        self,
        spec_path: str | os.PathLike | None = None,
        weights: str | os.PathLike | None = None,
        *,
        device: str = "auto",
        dtype: str | None = None,
        seed: int = 0,
        num_blocks: int | None = None,
        block_size: int | None = None,
        kv_cache_dtype: str | None = None,
        enable_prefix_caching: bool = True,
        use_kernels: bool | None = None,
        max_num_seqs: int = 64,
        max_num_batched_tokens: int = 2048,
        gpu_memory_utilization: float = 0.9,
        use_cuda_graphs: bool | None = None,
        max_model_len: int | None = None,
    ):
        """Load the model (seeded random weights without `weights`), compile its step model, start an engine.

        use_kernels: generated kernels (None: on CUDA only; on CPU the ops' reference implementations run,
        since Triton's interpreter is for testing codegen, far too slow to serve). block_size / kv_cache_dtype
        ("auto": the model's dtype, or "int8"): None takes the spec's `kv_cache = paged(block = 16, dtype = ...)`,
        else 16 and auto.
        """
        from kiln.build import load_model
        from kiln.compile.step import compile_step

        self.loaded = load_model(spec_path, weights, dtype=dtype, device=device, seed=seed)
        m = self.loaded
        kernels = m.device.type == "cuda" if use_kernels is None else use_kernels
        self.step_model = compile_step(m.gm, m.model, m.compile, device=m.device, use_kernels=kernels,
                                       kv_cache_dtype=kv_cache_dtype)
        self.tokenizer = m.tokenizer
        self.engine = Engine(
            self.step_model, m.tokenizer, m.model, num_blocks=num_blocks, block_size=block_size,
            max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens,
            enable_prefix_caching=enable_prefix_caching, gpu_memory_utilization=gpu_memory_utilization,
            use_cuda_graphs=use_cuda_graphs, max_model_len=max_model_len,
        )  # fmt: skip

    def generate(
        self,
        prompts: str | Sequence[str] | None = None,
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        *,
        prompt_token_ids: Sequence[int] | Sequence[Sequence[int]] | None = None,
    ) -> list[RequestOutput]:
        """Generate for every prompt in one continuous batch; the final outputs in prompt order."""
        ids = self._add(prompts, sampling_params, prompt_token_ids)
        final = {out.request_id: out for out in self._drain(ids) if out.finished}
        return [final[i] for i in ids]

    def generate_stream(
        self,
        prompts: str | Sequence[str] | None = None,
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        *,
        prompt_token_ids: Sequence[int] | Sequence[Sequence[int]] | None = None,
    ) -> Iterator[RequestOutput]:
        """Yield each request's output every step it grows (outputs[0].delta_text / delta_token_ids are new).

        Closing the generator early aborts the requests still running.
        """
        ids = self._add(prompts, sampling_params, prompt_token_ids)
        try:
            yield from self._drain(ids)
        finally:
            for rid in ids:  # no-op for the finished ones
                self.engine.abort(rid, notify=False)

    def _drain(self, ids: list[str]) -> Iterator[RequestOutput]:
        mine, left = set(ids), set(ids)
        while left:
            for out in self.engine.step():
                if out.request_id in mine:
                    yield out
                    if out.finished:
                        left.discard(out.request_id)

    def _add(self, prompts, sampling_params, prompt_token_ids) -> list[str]:
        if (prompts is None) == (prompt_token_ids is None):
            raise RequestError("give exactly one of prompts (text) and prompt_token_ids")
        if prompts is not None:
            items: list = [prompts] if isinstance(prompts, str) else list(prompts)
        else:
            ptids = list(prompt_token_ids)
            items = [ptids] if ptids and isinstance(ptids[0], int) else [list(p) for p in ptids]
        params = sampling_params if sampling_params is not None else SamplingParams()
        if isinstance(params, SamplingParams):
            params = [params] * len(items)
        elif len(params) != len(items):
            raise RequestError(f"sampling_params has {len(params)} entries for {len(items)} prompts; give one "
                               "SamplingParams or one per prompt")
        ids: list[str] = []
        try:
            for item, p in zip(items, params, strict=True):
                ids.append(self.engine.add_request(item, p))
        except KilnError:
            for rid in ids:  # all or nothing: a bad prompt leaves no half-submitted batch behind
                self.engine.abort(rid, notify=False)
            raise
        return ids
