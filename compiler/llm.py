"""The Python API: a model (a spec, a checkpoint directory or a .gguf file) in, batched generation out, in vLLM's
shape.

    from kiln import LLM, SamplingParams
    llm = LLM("tiny-llama")  # or LLM("path/to/hf_checkpoint"), LLM("model.gguf"), LLM(model="...")
    outs = llm.generate(["Hello", "Once upon"], SamplingParams(temperature=0, max_tokens=16))
    print(outs[0].outputs[0].text)

LLM's engine requests (adding a call's prompts, routing outputs, merging n choices) are kiln.llm_requests'
LLMRequests; the prompt forms generate takes are read by kiln.llm_prompts.
"""

from __future__ import annotations

import os
import sys
import threading
from collections import deque
from collections.abc import Callable, Iterator, Mapping, Sequence

import torch

from kiln.build import load_model, say
from kiln.chat_template import ChatTemplate, ChatTemplateError, chat_template_of, check_template_kwargs, message_text
from kiln.compile.step import compile_step
from kiln.env import progress_bars
from kiln.errors import KilnError, RequestError
from kiln.llm_prompts import _one_prompt, _text_prompts, _token_prompts  # noqa: F401  (moved: importable from here too)
from kiln.llm_requests import LLMRequests, _merge_metrics, _Prompt  # noqa: F401  (_Prompt, _merge_metrics: likewise)
from kiln.model_config import SpeculationConfig
from kiln.runtime.engine import Engine
from kiln.runtime.request import RequestOutput
from kiln.runtime.sampling_params import SEED_MAX, SamplingParams
from kiln.speculation import build_drafter, prepare_drafter, resolve_speculation


class LLM(LLMRequests):
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
        fields ({"kind": "ngram", "n": 3, "k": 4}), or "off" / {"kind": "off"} (none, whatever the spec says); None
        takes the spec's `speculation` key (if any).
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
        """The model's tokenizer as vLLM's LLM.get_tokenizer() returns it: AutoTokenizer.from_pretrained's, of the
        class the checkpoint names (LlamaTokenizerFast, Qwen2TokenizerFast, ...; PreTrainedTokenizerFast for one
        transformers lacks) with that class's behaviour; a GGUF's of the class transformers' GGUF loader picks, over
        a copy of llm.tokenizer's `tokenizers` backend (llm.tokenizer is the engine's, with kiln's defaults). Built
        on the first call, the same object on every call after. A KilnError without transformers (`pip install
        transformers`) or for a model with no tokenizer.json (kiln's byte-level fallback)."""
        # Not annotated: transformers is optional, and kiln.llm may not import kiln.tokenizer (docs/ARCHITECTURE.md).
        return self.tokenizer.transformers_tokenizer

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
        return self._finals(groups, use_tqdm)

    def _finals(self, groups: list[_Prompt], use_tqdm: bool | Callable) -> list[RequestOutput]:
        """The added prompts' final outputs, in order, with generate's progress bar."""
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
        tools: Sequence[Mapping[str, object]] | None = None,
    ) -> list[RequestOutput]:
        """Generate the assistant's reply to one conversation ([{"role": ..., "content": ...}, ...]) or to each of
        a list of them, through the model's chat template (the checkpoint's or the GGUF's; kiln's default for a
        model without one, with a warning once), in one continuous batch. The final outputs, in order.
        chat_template: a template to use instead (its text, or a file holding it); chat_template_kwargs: more
        variables for the template (e.g. {"enable_thinking": False} for Qwen3's), as in vLLM. add_generation_prompt
        and continue_final_message are vLLM's (and transformers' apply_chat_template's): with
        continue_final_message (and add_generation_prompt False) the prompt ends inside the final message, which
        the reply continues. tools: tool definitions ({"type": "function", "function": {...}}) given to the template
        as `tools`, as vLLM's LLM.chat gives them (kiln parses no tool calls out of the reply)."""
        prompts = self.chat_prompts(messages, add_generation_prompt=add_generation_prompt,
                                    continue_final_message=continue_final_message, chat_template=chat_template,
                                    chat_template_kwargs=chat_template_kwargs, tools=tools)
        # The template writes the special tokens it wants (BOS): the tokenizer adds none, as vLLM's LLM.chat and the
        # server's chat encode (transformers' apply_chat_template(tokenize=True) ids).
        groups = self._add(prompts, sampling_params, None, output_kind="final_only", add_special=False)
        return self._finals(groups, use_tqdm)

    def chat_prompts(self, messages: Sequence[dict] | Sequence[Sequence[dict]], *, add_generation_prompt: bool = True,
                     continue_final_message: bool = False,
                     chat_template: str | os.PathLike | ChatTemplate | None = None,
                     chat_template_kwargs: Mapping[str, object] | None = None,
                     tools: Sequence[Mapping[str, object]] | None = None) -> list[str]:
        """The prompt text `chat` sends for each conversation (encoded without the special tokens the tokenizer adds:
        the template writes its own)."""
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
        if tools is not None:
            if isinstance(tools, (str, Mapping)) or not isinstance(tools, Sequence) or not all(
                    isinstance(tool, Mapping) for tool in tools):
                raise RequestError('tools must be a list of tool definitions ({"type": "function", "function": '
                                   '{"name": ..., ...}}), or None', param="tools")
            if kwargs and "tools" in kwargs:
                raise RequestError("tools given twice: as tools= and in chat_template_kwargs; give them once",
                                   param="tools")
            kwargs = {**(kwargs or {}), "tools": [dict(tool) for tool in tools]}
        prompts = []
        for i, conv in enumerate(convs):
            if not conv or not all(isinstance(m, dict) for m in conv):
                raise RequestError(f"conversation {i} must be a non-empty list of message dicts")
            bad = next((j for j, m in enumerate(conv) if not isinstance(m.get("role"), str) or not m["role"]), None)
            if bad is not None:
                raise RequestError(f"conversation {i}, message {bad}: needs a 'role' (e.g. \"user\")")
            if continue_final_message and conv[-1].get("content") is None:  # as the server and transformers refuse it
                raise RequestError(f"conversation {i}: continue_final_message: the final message has no content to "
                                   'continue; give it text (an empty string "" continues from the start of the reply)')
            try:
                # OpenAI's content parts made text as the server makes them (the caller's dicts are left as they are)
                # (content may be left out, as OpenAI's assistant message with tool_calls: "", as the server has it)
                msgs = [{**m, "content": message_text(m.get("content"))} for m in conv]
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



def _progress(total: int, use_tqdm: bool | Callable = True):
    """The bar of generate: tqdm's, or the caller's factory."""
    if callable(use_tqdm):
        return use_tqdm(total=total, desc="kiln: generating", unit="req", file=sys.stderr)
    from tqdm import tqdm  # lazy: only a caller who asks for the bar pays for the import

    return tqdm(total=total, desc="kiln: generating", unit="req", file=sys.stderr, dynamic_ncols=True)
