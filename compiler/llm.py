"""The Python API: a model (a spec, a checkpoint directory or a .gguf file) in, batched generation out, in vLLM's
shape.

    from kiln import LLM, SamplingParams
    llm = LLM("tiny-llama")  # or LLM("path/to/hf_checkpoint"), LLM("model.gguf"), LLM(model="...")
    outs = llm.generate(["Hello", "Once upon"], SamplingParams(temperature=0, max_tokens=16))
    print(outs[0].outputs[0].text)
"""

from __future__ import annotations

import dataclasses
import operator
import os
import sys
import threading
from collections import deque
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field

import torch

from kiln.build import load_model, say
from kiln.chat_template import ChatTemplate, ChatTemplateError, chat_template_of, check_template_kwargs, message_text
from kiln.compile.step import compile_step
from kiln.env import progress_bars
from kiln.errors import KilnError, RequestError
from kiln.model_config import SpeculationConfig
from kiln.runtime.engine import Engine
from kiln.runtime.request import CompletionOutput, RequestMetrics, RequestOutput, truncate_prompt
from kiln.runtime.sampling_params import SEED_MAX, SamplingParams
from kiln.speculation import build_drafter, prepare_drafter, resolve_speculation


class LLM:
    def __init__(
        self,
        model: str | os.PathLike | None = None,
        weights: str | os.PathLike | None = None,
        *,
        device: str = "auto",
        dtype: str | torch.dtype | None = None,
        quantize: str | None = None,
        routers: str | os.PathLike | None = None,
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
        speculation: SpeculationConfig | str | dict | None = None,
        overlap_outputs: bool | None = None,
        async_scheduling: bool | None = None,
        generation_config: str | os.PathLike = "auto",
    ):
        """Load the model (seeded random weights without `weights`), compile its step model, start an engine.

        model: a .kiln spec or a bundled spec name, or, the vLLM way, a Hugging Face checkpoint directory or a .gguf
        file (then the spec comes from the checkpoint, as with weights alone; not with weights too). kiln loads
        local files only: a Hub id is an error saying how to download it. dtype ("fp32", "fp16", "bf16", vLLM's
        "auto", "half", "float16", "bfloat16", "float", "float32", or a torch.dtype; "auto": the spec's, or a
        checkpoint's own) and quantize ("int8", "int4", "int4-gptq-g64", ...: see `kiln run --quantize`) override
        the spec's compile block. seed: seeds random weights, and torch's global generators (CPU and CUDA) once
        loaded, which unseeded requests sample from, so a script run again samples the same tokens (as vLLM's
        seed). generation_config: "auto" (vLLM's default) takes the checkpoint's generation_config.json sampling
        defaults (temperature, top_p, top_k, min_p, repetition_penalty, max_new_tokens as max_tokens) as
        get_default_sampling_params(), which generate / chat use without sampling_params; "vllm": kiln's own
        SamplingParams defaults; or a directory holding a generation_config.json. routers: a `kiln train-router`
        file whose Mixture-of-Depths routers are attached to the dense model (its routing is in the file).

        use_kernels: generated kernels (None: on CUDA only; on CPU the ops' reference implementations run,
        since Triton's interpreter is for testing codegen, far too slow to serve). block_size / kv_cache_dtype
        ("auto": the model's dtype, or "int8"): None takes the spec's `kv_cache = paged(block = 16, dtype = ...)`,
        else 16 and auto. speculation: speculative decoding's drafter, as a kiln.model_config.SpeculationConfig,
        its spec syntax ("ngram(n = 3, k = 4)", "self(layers = 2)", 'draft(spec = "...", k = 4)'), a dict of its
        fields ({"kind": "ngram", "n": 3, "k": 4}) or "off"; None takes the spec's `speculation` key (if any).
        overlap_outputs: make each step's outputs during the next step's model call (None: on for CUDA; see
        kiln.runtime.engine.Engine). async_scheduling: launch each decode step before the last one's sampled ids
        reach the host (None: on for CUDA without speculation or routed layers; see Engine).
        """
        if isinstance(seed, bool) or not isinstance(seed, int) or not 0 <= seed <= SEED_MAX:
            raise KilnError(f"seed = {seed!r} is out of range; allowed: an integer 0 .. 2**64 - 1")
        self.loaded = load_model(model, weights, dtype=dtype, device=device, seed=seed, quantize=quantize,
                                 routers=routers, generation_config=generation_config)
        m = self.loaded
        kernels = m.device.type == "cuda" if use_kernels is None else use_kernels
        self.speculation = resolve_speculation(speculation, m, "speculation")
        # Before compile_step, which rewrites m.gm in place: the self drafter is cut from the Level-1 graph.
        plan = prepare_drafter(self.speculation, m, seed=seed) if self.speculation is not None else None
        self.step_model = compile_step(m.gm, m.model, m.compile, device=m.device, use_kernels=kernels,
                                       kv_cache_dtype=kv_cache_dtype)
        self.tokenizer = m.tokenizer
        # Only with speculation: without it the engine is built exactly as before.
        drafter = {"drafter": build_drafter(plan, self.step_model)} if plan is not None else {}
        self.engine = Engine(
            self.step_model, m.tokenizer, m.model, num_blocks=num_blocks, block_size=block_size,
            max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens,
            enable_prefix_caching=enable_prefix_caching, gpu_memory_utilization=gpu_memory_utilization,
            use_cuda_graphs=use_cuda_graphs, max_model_len=max_model_len, overlap_outputs=overlap_outputs,
            async_scheduling=async_scheduling, **drafter,
        )  # fmt: skip
        # Outputs are routed to a queue per request, so any number of generate / generate_stream callers (and
        # threads) can share the engine: whoever steps it delivers everyone's outputs, and nothing is dropped.
        self._queues: dict[str, deque[RequestOutput]] = {}
        self._lock = threading.RLock()
        note = m.generation_note()
        if note is not None:
            say(note)
        # Last, once loading and compiling (which may draw random numbers) are done: unseeded requests draw from
        # these generators, so the same script samples the same tokens (vLLM seeds its workers the same way).
        torch.manual_seed(seed)

    def get_tokenizer(self):
        """The model's tokenizer (kiln.tokenizer.Tokenizer: encode, decode, eos_token_ids, chat_template), as
        vLLM's LLM.get_tokenizer()."""
        return self.tokenizer

    def get_default_sampling_params(self) -> SamplingParams:
        """The SamplingParams generate and chat use when given none: the checkpoint's generation_config.json
        defaults (LoadedModel.generation_defaults) over kiln's, unless LLM(generation_config="vllm"), as vLLM's."""
        return SamplingParams(**self.loaded.generation_defaults)

    def generate(
        self,
        prompts: str | Sequence[str] | None = None,
        sampling_params: SamplingParams | dict | Sequence[SamplingParams | dict] | None = None,
        *,
        prompt_token_ids: Sequence[int] | Sequence[Sequence[int]] | None = None,
        use_tqdm: bool | Callable = True,
    ) -> list[RequestOutput]:
        """Generate for every prompt in one continuous batch; the final outputs in prompt order.

        A prompt is a str, a {"prompt": str} or {"prompt_token_ids": [...]} dict (vLLM's forms), or token ids
        through prompt_token_ids. sampling_params None: get_default_sampling_params(). use_tqdm (on by default, as
        in vLLM): a tqdm progress bar of finished prompts on stderr (tqdm's TQDM_DISABLE=1 turns it off); a callable
        is used in tqdm's place, as vLLM takes one (called with total=, desc=, unit=, file=). A request that fails
        alone ends with finish_reason "error" (the message in RequestOutput.error). If generate itself raises (or
        is interrupted), every request it added is aborted, so the LLM stays usable. SamplingParams(n=k): each
        prompt's RequestOutput has k CompletionOutputs, index 0 .. k - 1 (see SamplingParams.choices for seeds).
        """
        # Only the final outputs are returned: the engine makes no others (no per-step copy of every output).
        groups = self._add(prompts, sampling_params, prompt_token_ids, output_kind="final_only")
        # TQDM_DISABLE read now (kiln.env), not when tqdm was imported, as kiln's other default-on bars read it
        bar = _progress(len(groups), use_tqdm) if use_tqdm and (callable(use_tqdm) or progress_bars()) else None
        final: dict[str, RequestOutput] = {}
        try:
            for out in self._merged(groups):
                if out.finished:
                    final[out.request_id] = out
                    if bar is not None:
                        bar.update(1)
        finally:
            self._release(groups)
            if bar is not None:
                bar.close()
        return [final[g.request_id] for g in groups]

    def chat(
        self,
        messages: Sequence[dict] | Sequence[Sequence[dict]],
        sampling_params: SamplingParams | dict | Sequence[SamplingParams | dict] | None = None,
        *,
        use_tqdm: bool | Callable = True,
        chat_template: str | os.PathLike | ChatTemplate | None = None,
        chat_template_kwargs: Mapping[str, object] | None = None,
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
    ) -> list[RequestOutput]:
        """Generate the assistant's reply to one conversation ([{"role": ..., "content": ...}, ...]) or to each of
        a list of them, through the model's chat template (the checkpoint's or the GGUF's; kiln's default for a
        model without one, with a warning once), in one continuous batch. The final outputs, in order.
        chat_template: a template to use instead (its text, or a file holding it); chat_template_kwargs: more
        variables for the template (e.g. {"enable_thinking": False} for Qwen3's), as in vLLM. add_generation_prompt
        and continue_final_message are vLLM's (and transformers' apply_chat_template's): with
        continue_final_message (and add_generation_prompt False) the prompt ends inside the final message, which
        the reply continues."""
        prompts = self.chat_prompts(messages, add_generation_prompt=add_generation_prompt,
                                    continue_final_message=continue_final_message, chat_template=chat_template,
                                    chat_template_kwargs=chat_template_kwargs)
        return self.generate(prompts, sampling_params, use_tqdm=use_tqdm)

    def chat_prompts(self, messages: Sequence[dict] | Sequence[Sequence[dict]], *, add_generation_prompt: bool = True,
                     continue_final_message: bool = False,
                     chat_template: str | os.PathLike | ChatTemplate | None = None,
                     chat_template_kwargs: Mapping[str, object] | None = None) -> list[str]:
        """The prompt text `chat` sends for each conversation."""
        if continue_final_message and add_generation_prompt:
            raise RequestError("continue_final_message and add_generation_prompt cannot both be true (as in vLLM and "
                               "transformers); pass add_generation_prompt=False to continue the final message")
        if isinstance(messages, (str, dict)) or not isinstance(messages, Sequence) or not messages:
            raise RequestError("messages must be a non-empty list of {'role': ..., 'content': ...} dicts (one "
                               "conversation) or a list of such lists")
        convs = [messages] if isinstance(messages[0], dict) else list(messages)
        try:
            template = chat_template_of(self.tokenizer, chat_template)
        except ChatTemplateError as e:
            raise RequestError(str(e), param="chat_template") from None
        kwargs = check_template_kwargs(dict(chat_template_kwargs) if isinstance(chat_template_kwargs, Mapping)
                                       else chat_template_kwargs)
        prompts = []
        for i, conv in enumerate(convs):
            if not conv or not all(isinstance(m, dict) and "role" in m and "content" in m for m in conv):
                raise RequestError(f"conversation {i} must be a non-empty list of dicts with 'role' and 'content'")
            if continue_final_message and conv[-1]["content"] is None:  # as the server and transformers refuse it
                raise RequestError(f"conversation {i}: continue_final_message: the final message has no content to "
                                   'continue; give it text (an empty string "" continues from the start of the reply)')
            try:
                # OpenAI's content parts made text as the server makes them (the caller's dicts are left as they are)
                msgs = [{**m, "content": message_text(m["content"])} for m in conv]
                prompts.append(template.render(msgs, add_generation_prompt, template_kwargs=kwargs,
                                               continue_final_message=continue_final_message))
            except (ChatTemplateError, RequestError) as e:
                raise RequestError(f"conversation {i}: {e}") from None
        return prompts

    def generate_stream(
        self,
        prompts: str | Sequence[str] | None = None,
        sampling_params: SamplingParams | dict | Sequence[SamplingParams | dict] | None = None,
        *,
        prompt_token_ids: Sequence[int] | Sequence[Sequence[int]] | None = None,
    ) -> Iterator[RequestOutput]:
        """Yield each request's output every step it grows (outputs[0].delta_text / delta_token_ids are new; with
        SamplingParams(output_kind="delta") the outputs carry only what is new, "final_only" yields one each).

        With SamplingParams(n=k) a prompt's k choices are k engine requests under one request_id (the first
        choice's): each output carries the choice that grew, with its index, and `finished` is set on the output
        after which all k have finished (final_only: one output with all k, when they have).

        Streams and generate calls may interleave freely. Closing the generator early aborts the requests still
        running.
        """
        groups = self._add(prompts, sampling_params, prompt_token_ids)
        try:
            yield from self._merged(groups)
        finally:
            self._release(groups)

    def _merged(self, groups: list[_Prompt]) -> Iterator[RequestOutput]:
        """_drain's outputs as the caller sees them: a prompt with one choice as the engine made them, one with n
        choices under its request_id, each choice's CompletionOutput indexed (see generate_stream)."""
        owner = {rid: (g, i) for g in groups for i, rid in enumerate(g.rids)}
        for out in self._drain(list(owner)):
            g, i = owner[out.request_id]
            if len(g.rids) == 1:
                yield out
                continue
            comp = dataclasses.replace(out.outputs[0], index=i)
            if g.final_only:
                g.latest[i] = comp
            if out.finished:
                g.metrics[i] = out.metrics
                if out.error is not None:
                    g.errors[i] = f"choice {i}: {out.error}"
            done = len(g.metrics) == len(g.rids)
            if g.final_only and not done:
                continue
            comps = [g.latest[j] for j in range(len(g.rids))] if g.final_only else [comp]
            errors = "; ".join(g.errors[j] for j in sorted(g.errors)) or None  # the failed choices' so far
            yield RequestOutput(g.request_id, out.prompt, out.prompt_token_ids, comps, done,
                                _merge_metrics([g.metrics[j] for j in sorted(g.metrics)]) if done else out.metrics,
                                errors, g.prompt_logprobs(out))

    def _drain(self, ids: list[str]) -> Iterator[RequestOutput]:
        """This caller's outputs: what is queued first, and a step of the engine whenever nothing is."""
        left = list(ids)
        while left:
            ready: list[RequestOutput] = []
            with self._lock:
                for rid in left:
                    ready += self._queues[rid]
                    self._queues[rid].clear()
                if not ready:
                    if not self.engine.has_unfinished():
                        raise KilnError(f"requests {left} left the engine without a final output (aborted through "
                                        "LLM.engine directly?); abort them through the LLM's generators instead")
                    self._route(self.engine.step())
            for out in ready:  # yielded outside the lock: the consumer may run other streams meanwhile
                if out.finished:
                    left.remove(out.request_id)
                yield out

    def _route(self, outputs: list[RequestOutput]) -> None:
        for out in outputs:
            q = self._queues.get(out.request_id)
            if q is not None:  # requests added through LLM.engine directly are not ours to keep
                q.append(out)

    def _release(self, groups: list[_Prompt]) -> None:
        with self._lock:
            for g in groups:
                for rid in g.rids:
                    self.engine.abort(rid, notify=False)  # no-op for the finished ones
                    self._queues.pop(rid, None)

    def _add(self, prompts, sampling_params, prompt_token_ids, output_kind: str | None = None) -> list[_Prompt]:
        if (prompts is None) == (prompt_token_ids is None):
            raise RequestError("give exactly one of prompts (text) and prompt_token_ids")
        if prompts is not None:
            items = _text_prompts(prompts)
        else:
            items = [("ids", p) for p in _token_prompts(prompt_token_ids)]
        clamp = sampling_params is None and "max_tokens" in self.loaded.generation_defaults
        if sampling_params is None:  # as vLLM: the model's generation_config.json defaults, unless "vllm"
            sampling_params = self.get_default_sampling_params()
        if isinstance(sampling_params, (SamplingParams, dict)):
            params = [SamplingParams.coerce(sampling_params)] * len(items)
        elif isinstance(sampling_params, (list, tuple)):
            params = [SamplingParams.coerce(p, f"sampling_params[{i}]") for i, p in enumerate(sampling_params)]
            if len(params) != len(items):
                raise RequestError(f"sampling_params has {len(params)} entries for {len(items)} prompts; give one "
                                   "SamplingParams or one per prompt")
        else:
            raise RequestError(f"sampling_params must be a SamplingParams, a dict of its fields or a list of those "
                               f"(one per prompt), not {type(sampling_params).__name__}")
        groups: list[_Prompt] = []
        with self._lock:
            try:
                for i, ((kind, item), p) in enumerate(zip(items, params, strict=True)):
                    try:
                        if output_kind is not None and p.output_kind != output_kind:
                            p = dataclasses.replace(p.validate(), output_kind=output_kind)  # a bad kind is named
                        group = _Prompt([], p.output_kind == "final_only", p.output_kind == "delta")
                        groups.append(group)
                        ids = self._truncated(kind, item, p)
                        if clamp:
                            p = self._within_context(*(("ids", ids) if ids is not None else (kind, item)), p)
                        for choice in p.choices():  # n > 1: one engine request per choice
                            if ids is not None:  # truncate_prompt_tokens: the ids kept, the text as given
                                rid = self.engine.add_request(item if kind == "text" else None, choice,
                                                              prompt_token_ids=ids)
                            elif kind == "text":
                                rid = self.engine.add_request(item, choice)
                            else:
                                rid = self.engine.add_request(params=choice, prompt_token_ids=item)
                            self._queues[rid] = deque()
                            group.rids.append(rid)
                    except RequestError as e:
                        if len(items) == 1:
                            raise
                        raise RequestError(f"prompt {i}: {e}", param=e.param, code=e.code) from None
            except BaseException:
                self._release(groups)  # all or nothing: a bad prompt leaves no half-submitted batch behind
                raise
        return groups

    def _within_context(self, kind: str, item: object, params: SamplingParams) -> SamplingParams:
        """A checkpoint's default max_tokens (generation_config.json's max_new_tokens) cut to what max_model_len
        leaves after this prompt, as vLLM stops there: a default the user never chose must not refuse a prompt.
        A prompt that leaves no room is left for the engine to name."""
        if kind == "text" and self.engine.tokenizer is None:
            return params
        try:
            n = len(self.engine.tokenizer.encode(item)) if kind == "text" else len(item)
        except TypeError:
            return params  # not a sequence of ids: the engine names it
        room = self.engine.max_model_len - n
        if 0 < room < params.max_tokens:
            return dataclasses.replace(params, max_tokens=room)
        return params

    def _truncated(self, kind: str, item: object, params: SamplingParams) -> Sequence[int] | None:
        """The prompt's ids as params.truncate_prompt_tokens keeps them (vLLM's: the last k, -1: the last
        max_model_len); None when it is not set."""
        if not isinstance(params, SamplingParams) or params.truncate_prompt_tokens is None:
            return None
        params.validate()  # a bad value is named before anything is encoded
        if kind == "text" and self.engine.tokenizer is None:
            return None  # the engine says why text needs a tokenizer
        ids = self.engine.tokenizer.encode(item) if kind == "text" else item
        return truncate_prompt(ids, params.truncate_prompt_tokens, self.engine.max_model_len)


@dataclass
class _Prompt:
    """One prompt of a generate / generate_stream call: its engine requests, one per choice (SamplingParams.n),
    and, with n > 1, what _merged keeps of them: each choice's final output (final_only), and its metrics and error
    once finished."""

    rids: list[str]
    final_only: bool
    delta: bool
    latest: dict[int, CompletionOutput] = field(default_factory=dict)
    metrics: dict[int, RequestMetrics] = field(default_factory=dict)
    errors: dict[int, str] = field(default_factory=dict)
    prompt: list | None = None  # prompt_logprobs, from the first choice output with them
    prompt_given: bool = False

    @property
    def request_id(self) -> str:
        return self.rids[0]

    def prompt_logprobs(self, out: RequestOutput) -> list | None:
        """What a merged output carries of the prompt's logprobs (every choice scores the same prompt): like one
        request's outputs, on every output once known, or once for "delta" ones."""
        if self.prompt is None and out.prompt_logprobs is not None:
            self.prompt = out.prompt_logprobs
        if self.prompt is None or (self.delta and self.prompt_given):
            return None
        self.prompt_given = True
        return self.prompt


def _merge_metrics(ms: list[RequestMetrics]) -> RequestMetrics:
    """One prompt's metrics over its choices: from the first arrival to the last finish, the first token of any
    choice (as vLLM reports a request with n > 1), counts summed."""
    def first(name: str) -> float | None:
        vals = [getattr(m, name) for m in ms if getattr(m, name) is not None]
        return min(vals) if vals else None

    finishes = [m.finish_time for m in ms if m.finish_time is not None]
    return RequestMetrics(min(m.arrival_time for m in ms), first_scheduled_time=first("first_scheduled_time"),
                          first_token_time=first("first_token_time"), finish_time=max(finishes) if finishes else None,
                          num_preemptions=sum(m.num_preemptions for m in ms),
                          num_cached_tokens=sum(m.num_cached_tokens for m in ms),
                          num_draft_tokens=sum(m.num_draft_tokens for m in ms),
                          num_accepted_tokens=sum(m.num_accepted_tokens for m in ms))


def _progress(total: int, use_tqdm: bool | Callable = True):
    """The bar of generate: tqdm's, or the caller's factory."""
    if callable(use_tqdm):
        return use_tqdm(total=total, desc="kiln: generating", unit="req", file=sys.stderr)
    from tqdm import tqdm  # lazy: only a caller who asks for the bar pays for the import

    return tqdm(total=total, desc="kiln: generating", unit="req", file=sys.stderr, dynamic_ncols=True)


def _text_prompts(prompts: object) -> list[tuple[str, object]]:
    """("text", str) or ("ids", token ids) per prompt: a str, a vLLM-style {"prompt": str} or
    {"prompt_token_ids": [...]} dict, or a list of those (or of token-id lists)."""
    if isinstance(prompts, (str, dict)):
        return [_one_prompt(prompts, "prompts")]
    if isinstance(prompts, (bytes, bytearray)) or not isinstance(prompts, Sequence):
        raise RequestError(f"prompts must be a str, a {{'prompt': str}} or {{'prompt_token_ids': [...]}} dict, or "
                           f"a list of those, not {type(prompts).__name__} (token ids go in prompt_token_ids)")
    if prompts and all(isinstance(p, int) for p in prompts):
        raise RequestError("prompts is a list of ints: one prompt's token ids go in prompt_token_ids=[...] (or "
                           "prompts=[{'prompt_token_ids': [...]}]), as in vLLM; prompts takes text")
    return [_one_prompt(p, f"prompts[{i}]") for i, p in enumerate(prompts)]


def _one_prompt(p: object, what: str) -> tuple[str, object]:
    if isinstance(p, str):
        return "text", p
    if isinstance(p, dict):
        keys = set(p)
        if keys == {"prompt"} and isinstance(p["prompt"], str):
            return "text", p["prompt"]
        if keys == {"prompt_token_ids"}:
            return "ids", p["prompt_token_ids"]
        raise RequestError(f"{what} is a dict with keys {sorted(map(str, keys))}; kiln takes {{'prompt': str}} or "
                           "{'prompt_token_ids': [ids]} (no multi-modal data or other fields)")
    if isinstance(p, (list, tuple)) or getattr(p, "ndim", None) == 1:  # one prompt's token ids (checked by the engine)
        return "ids", p
    raise RequestError(f"{what} is {type(p).__name__}, not a prompt: give a str, a {{'prompt': str}} / "
                       "{'prompt_token_ids': [...]} dict, or a list of token ids")


def _token_prompts(prompt_token_ids: object) -> list:
    """One prompt (a sequence of ints, a 1-D array or tensor) or several (a list of those, a 2-D array) as a
    list of prompts; the engine checks each one's ids."""
    ndim = getattr(prompt_token_ids, "ndim", None)
    if ndim is not None:  # numpy arrays and tensors
        if ndim == 1:
            return [prompt_token_ids]
        if ndim == 2:
            return list(prompt_token_ids)  # type: ignore[call-overload]
        raise RequestError(f"prompt_token_ids has {ndim} dimensions; give one prompt (1-D) or a batch (2-D)")
    if isinstance(prompt_token_ids, (str, bytes, dict)):
        raise RequestError(f"prompt_token_ids must be token ids (a list of ints, or a list of such lists), not "
                           f"{type(prompt_token_ids).__name__}; text goes in prompts")
    try:
        items = list(prompt_token_ids)  # type: ignore[call-overload]
    except TypeError:
        raise RequestError(f"prompt_token_ids must be a sequence of token ids or a list of them, not "
                           f"{type(prompt_token_ids).__name__}") from None
    if not items:
        raise RequestError("prompt_token_ids is empty; give at least one prompt of at least one token")
    try:
        operator.index(items[0])
        return [items]  # one prompt
    except TypeError:
        return items
