"""`kiln run`: compile a spec (or a checkpoint) and generate text from one prompt through the serving engine."""

from __future__ import annotations

import argparse
import dataclasses
import json
import re
import sys
import time

from kiln.cli.common import (
    chat_template_flag,
    device_flag,
    dtype_flag,
    engine_flags,
    generation_config_flag,
    model_paths_resolved,
    quantize_flag,
    routers_flag,
    seed_flag,
    serving_engine,
    spec_arg,
    weights_flag,
)
from kiln.errors import KilnError, RequestError, UsageError
from kiln.runtime.prompt_limits import resolve_max_tokens
from kiln.runtime.sampling_params import SamplingParams
from kiln.spec.validate import describe_route

MAX_TOKENS = 32  # kiln run's own default, when neither --max-tokens nor the checkpoint's max_new_tokens says
# The sampling flags, by SamplingParams field: the ones given win over the checkpoint's generation_config.json
# defaults (--generation-config auto), which win over SamplingParams' own.
SAMPLING_FLAGS = ("temperature", "top_k", "top_p", "min_p", "repetition_penalty", "max_tokens")
# The flag each of those fields is typed as: SamplingParams' errors name the field, the user typed the flag. (--stop
# and --seed are checked by argparse, so SamplingParams never names them here.)
FLAG_OF = {name: "--" + name.replace("_", "-") for name in SAMPLING_FLAGS}


def _by_flag(e: RequestError) -> RequestError:
    """A RequestError about a value a sampling flag gave (SamplingParams.validate's, resolve_max_tokens'), worded with
    the flag (--top-k, not top_k); any other unchanged. The Python API keeps the field names."""
    flag = FLAG_OF.get(e.param)
    if flag is None:
        return e
    text = re.sub(rf"\b{e.param}\b", flag, str(e))
    text = re.sub(rf"^sampling parameter {flag} = ", f"{flag} ", text)
    # A flag left out is the checkpoint's default or kiln run's, never SamplingParams' None ("up to the context")
    return RequestError(re.sub(r", or None( \([^)]*\))?$", "", text), param=e.param, code=e.code)


def _stop(text: str) -> str:
    if not text:  # SamplingParams refuses an empty stop string: it would end generation before the first token
        raise argparse.ArgumentTypeError("is empty; give the text to end generation at, or leave --stop out")
    return text


def _ids(text: str) -> list[int]:
    parts = text.replace(" ", "").split(",")
    if parts == [""]:
        raise argparse.ArgumentTypeError("--prompt-ids is empty; give at least one token id, e.g. 1,2,3")
    if "" in parts:  # `1,,2` (or a stray leading / trailing comma) is a typo for some id, not two ids
        raise argparse.ArgumentTypeError(f"--prompt-ids {text!r} has an empty item (two commas in a row, or a comma "
                                         "at either end); give integers separated by single commas, e.g. 1,2,3")
    try:
        return [int(t) for t in parts]
    except ValueError:
        raise argparse.ArgumentTypeError(f"--prompt-ids must be comma-separated integers, got {text!r}") from None


def cmd_run(args: argparse.Namespace) -> int:
    # lazy: loads torch, which `kiln check`, `kiln fmt` and `kiln --help` never need
    from kiln.build import load_model, say

    given = {name: getattr(args, name) for name in SAMPLING_FLAGS if getattr(args, name) is not None}
    # speculate=True: in a batch of one whether speculation runs never depends on other requests, so a seeded
    # request stays reproducible with it (SamplingParams.speculate leaves seeded sampling out only for that reason).
    params = SamplingParams(**{"max_tokens": MAX_TOKENS, **given}, seed=args.seed, stop=tuple(args.stop),
                            speculate=True)
    try:
        params.validate()  # the flags, checked before anything loads
    except RequestError as e:
        raise _by_flag(e) from None
    if args.chat and args.prompt_ids is not None:  # ids are the prompt as given: there is no text to wrap
        raise UsageError("--chat wraps --prompt's text in the chat template; --prompt-ids is the prompt as given "
                         "(render the template yourself, or pass --prompt)")
    if args.chat_template is not None and not args.chat:
        raise UsageError("--chat-template is the template --chat wraps the prompt in; add --chat")
    t0 = time.perf_counter()
    m = load_model(args.spec, args.weights, dtype=args.dtype, device=args.device, seed=args.seed or 0,
                   quantize=args.quantize, routers=args.routers, generation_config=args.generation_config)
    prompt = args.prompt
    if args.chat and args.prompt_ids is None:
        from kiln.chat_template import chat_template_of  # lazy: jinja2, which only a chat needs

        # the template LLM.chat and kiln serve use: --chat-template, the model's own, else kiln's default (warned)
        prompt = chat_template_of(m.tokenizer, args.chat_template).render([{"role": "user", "content": prompt}])
    if args.prompt_ids is not None:
        prompt_ids = args.prompt_ids
    else:
        from kiln.tokenizer import encode_text  # lazy: kiln.tokenizer loads torch, which `kiln --help` never needs

        # A chat prompt gets no special tokens from the tokenizer (the template writes BOS), as LLM.chat and the server
        prompt_ids = encode_text(m.tokenizer, prompt, add_special=not args.chat)
    defaults = {k: v for k, v in m.generation_defaults.items() if k not in given}
    if defaults:  # the checkpoint's recommendation for the flags not given, as vLLM's --generation-config auto
        params = dataclasses.replace(params, **defaults)
        flags = ", ".join(sorted(FLAG_OF[name] for name in given))
        say(m.generation_note() + (f"; flags given win ({flags})" if given else ""))
    # Without --max-tokens the limit (the checkpoint's max_new_tokens, else MAX_TOKENS) is a default the user never
    # chose: cut to what the context (the engine's max_model_len, made below) leaves after the prompt, by the
    # engine's own rule; known here to size the pool. Only a --max-tokens given can be refused for it.
    try:
        params = dataclasses.replace(params, max_tokens=resolve_max_tokens(
            params.max_tokens, len(prompt_ids), m.model.context, is_default="max_tokens" not in given))
    except RequestError as e:  # a --max-tokens past what the context leaves
        raise _by_flag(e) from None
    # One request: the pool only needs room for it (a longer one is refused below with the model's context).
    total = len(prompt_ids) + params.max_tokens
    from kiln.runtime.kv_pool import PoolTooSmallError  # lazy: torch, which `kiln --help` never needs

    try:
        engine = serving_engine(args, m, max_num_seqs=1, max_model_len=total if total <= m.model.context else None)
    except PoolTooSmallError as e:  # the longest sequence here is this prompt + --max-tokens, not a --max-model-len
        room, usable = e.usable_tokens - len(prompt_ids), e.usable_tokens
        shorten = (f"lower --max-tokens to at most {room} (the pool holds {usable} tokens, the prompt "
                   f"{len(prompt_ids)})" if room >= 1 else
                   f"shorten the prompt (its {len(prompt_ids)} tokens fill the pool's {usable})" if usable >= 2 else
                   None)  # a pool without room for one prompt token and one generated: only raising it helps
        raise e.advised("--num-blocks", "--gpu-memory-utilization", shorten) from None
    quant = m.quantize_label()
    say(f"loaded {m.model.name} from {m.source} on {m.device} ({m.compile.dtype}{', ' + quant if quant else ''}"
        f"{m.weights_label()}) in {time.perf_counter() - t0:.2f}s")
    st = engine.stats
    if st.routed_blocks:  # Mixture-of-Depths: routed layers cache only their routed tokens
        say(f"{describe_route(m.model)}, served in the causal form (router score > threshold, or predictor logit "
            f"> 0); routed KV cache: {st.kv_bytes / 2**20:.1f} MiB" + (
                f", {st.kv_bytes_saved / 2**20:.1f} MiB ({st.kv_bytes_saved / st.kv_bytes_dense:.0%}) less than "
                "caching every token in every layer" if st.kv_bytes_saved > 0 else
                " (a routed layer's pool holds at least one full-length sequence, so one request saves no memory; "
                "with many, e.g. in `kiln serve`, each routed layer caches about its capacity's share)"))
    engine.add_request(prompt_token_ids=prompt_ids, params=params)
    final = None
    for out in engine.stream():
        if not args.json:
            sys.stdout.write(out.outputs[0].delta_text)
            sys.stdout.flush()
        final = out
    assert final is not None and final.finished
    if final.outputs[0].finish_reason == "error":  # e.g. NaN logits: the engine has logged why; no traceback
        raise KilnError(f"generation stopped after {len(final.outputs[0].token_ids)} token(s) (the reason is above)")
    gen, metrics = final.outputs[0], final.metrics
    n = len(gen.token_ids)
    decode_s = metrics.finish_time - metrics.first_token_time
    # One token has no decode rate (null in JSON, n/a on stderr), rather than a made-up 0.0.
    rate = (n - 1) / decode_s if n > 1 and decode_s > 0 else None
    timings = {"ttft_s": metrics.ttft_s, "decode_tokens_per_s": rate}
    if args.json:
        out = {"token_ids": gen.token_ids, "text": gen.text, "prompt_token_ids": list(prompt_ids),
               "finish_reason": gen.finish_reason, "stop_reason": gen.stop_reason, "model": m.model.name,
               "device": str(m.device), **timings}
        print(json.dumps(out))
    else:
        print()
    rate_text = f"{rate:.1f} tokens/s" if rate is not None else "no decode rate (one token)"
    say(f"{n} tokens, time to first token {timings['ttft_s'] * 1e3:.1f} ms, {rate_text} (paged KV cache engine)")
    st = engine.stats
    if st.spec_proposed:  # speculation ran: how much of it paid
        say(f"speculation: {st.spec_accepted} of {st.spec_proposed} draft tokens accepted "
            f"({st.acceptance_rate:.0%}), {st.mean_accepted_length:.2f} tokens per verified step")
    return 0


def add_run_parser(sub: argparse._SubParsersAction) -> None:
    r = sub.add_parser("run", help="compile a spec and generate text", description="Compile a spec and generate.")
    spec_arg(r)
    weights_flag(r)
    r.add_argument("--chat", action="store_true", help="wrap --prompt in the tokenizer's chat template (one user turn)")
    g = r.add_mutually_exclusive_group(required=True)
    g.add_argument("--prompt", metavar="TEXT", help="prompt text (tokenized with the checkpoint's tokenizer)")
    g.add_argument("--prompt-ids", metavar="1,2,3", type=_ids, help="prompt as comma-separated token ids")
    # None: not given, so the checkpoint's generation_config.json default (--generation-config), else kiln's
    r.add_argument("--max-tokens", type=int, help=f"tokens to generate (default: the checkpoint's max_new_tokens, "
                   f"else {MAX_TOKENS}, either cut to what the context leaves after the prompt)")
    r.add_argument("--temperature", type=float, help="0 is greedy (default: the checkpoint's, else 1.0)")
    r.add_argument("--top-k", type=int, help="keep the k most likely tokens (0: off; default: the checkpoint's, "
                   "else off)")
    r.add_argument("--top-p", type=float, help="nucleus sampling mass in (0, 1] (default: the checkpoint's, else 1.0)")
    r.add_argument("--min-p", type=float, help="drop tokens less likely than min_p times the most likely one, in "
                   "[0, 1] (default: the checkpoint's, else 0: off)")
    r.add_argument("--repetition-penalty", type=float, help="HF's repetition penalty, > 0 (default: the "
                   "checkpoint's, else 1.0: off)")
    r.add_argument("--stop", metavar="TEXT", action="append", default=[], type=_stop,
                   help="end generation at this text, left out of the output (repeat the flag for several)")
    seed_flag(r, default=None, help="seed for sampling and random weights")
    device_flag(r)
    dtype_flag(r)
    r.add_argument("--json", action="store_true", help="print one JSON object with token_ids, text and timings")
    quantize_flag(r)
    routers_flag(r)
    generation_config_flag(r)
    chat_template_flag(r)
    engine_flags(r)
    r.set_defaults(func=model_paths_resolved(cmd_run))
