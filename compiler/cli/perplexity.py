"""`kiln bench perplexity`: perplexity of a model on real text, for several weight formats of the same weights.

The text is tokenized once and cut into consecutive windows of `window` tokens; every token of a window but
the first is scored given the ones before it in that window (llama.cpp's perplexity tool scores only the
second half of each window; scoring all but the first gives a slightly higher, equally comparable figure).
Variants: fp32 / bf16 / fp16 (the dense model in that dtype), `gguf` (a GGUF's Q4_0 / Q4_1 / Q8_0 linears kept
as stored), or any kiln scheme (int8, int4-rtn-g32, int4-gptq-g128, ...) applied by the quantize pass; GPTQ
calibrates on `calibration` text when given (keep it apart from the evaluated text), else seeded random tokens.
`kv-int8` / `kv-auto` score the fp32 weights through the cached step model (compile_step) with an int8 / a
model-dtype KV cache: every window is prefilled in chunks of `chunk` tokens, so each chunk attends to the
cached K/V of the chunks before it and the figure carries the int8 cache's rounding (kv-auto is its control).
"""

from __future__ import annotations

import json
import math
import os
import time
from pathlib import Path

import torch
from torch import fx

from kiln.build import describe_model, load_model, say
from kiln.cli.perplexity_parser import DEFAULT_VARIANTS, DEFAULT_WINDOW
from kiln.cli.text_input import read_text_file
from kiln.compile.pipeline import quantize_graph
from kiln.compile.quantized import is_quantized_checkpoint, stored_scheme
from kiln.compile.step import allocate_kv_cache, compile_step
from kiln.errors import KilnError
from kiln.gguf.files import bundled_weights, is_gguf
from kiln.model_config import DTYPES
from kiln.quant.formats import parse_scheme
from kiln.quant.sizing import fitting_group, quantized_weights, resolve_group
from kiln.run_info import run_metadata
from kiln.step import StepBatch

_KV_VARIANTS = {"kv-int8": "int8", "kv-auto": "auto"}
KV_CHUNK = 128  # prefill chunk of the kv-* variants: a 512-token window is scored in 4 steps, 3 over the cache


def check_full_precision(weights: str | os.PathLike | None, command: str) -> None:
    """A KilnError when `weights` is a `kiln quantize` output: `command` measures against (or trains on) the
    unquantized weights, which such a checkpoint no longer has, so every figure would be false."""
    if weights is not None and not is_gguf(weights) and is_quantized_checkpoint(weights):
        raise KilnError(f"--weights {weights}: is a `kiln quantize` output ({stored_scheme(weights).label}); "
                        f"{command} needs full-precision weights: give the original checkpoint")


def fit_window(window: int | None, context: int, flag: str, default: int) -> tuple[int, str | None]:
    """(tokens per window, a note or None): `default` capped to the model's context (with a note), or the given
    window, which must be 2 .. context (a learned-position model has no position past it; a rope model's would be
    extrapolated, not measured)."""
    if window is None:
        if default <= context:
            return default, None
        return context, f"{flag} defaults to {default} tokens; using {context}, the model's context"
    if not 2 <= window <= context:
        raise KilnError(f"{flag} {window}: give 2 to {context} tokens (the model's context is {context})")
    return window, None


def window_nll(gm: fx.GraphModule, ids: list[int], window: int) -> tuple[float, int]:
    """(sum of negative log-likelihoods in nats, tokens scored) over consecutive windows of `ids`."""
    device = next(iter(gm.parameters())).device if any(True for _ in gm.parameters()) else torch.device("cpu")
    total, count = 0.0, 0
    with torch.no_grad():
        for lo in range(0, len(ids) - 1, window):
            chunk = torch.tensor([ids[lo:lo + window]], device=device)
            if chunk.shape[1] < 2:
                break
            logits = gm(chunk, torch.arange(chunk.shape[1], device=device)[None]).float()
            logp = torch.log_softmax(logits[0, :-1], dim=-1)
            total -= logp.gather(1, chunk[0, 1:, None]).sum().item()
            count += chunk.shape[1] - 1
    return total, count


def step_window_nll(step, ids: list[int], window: int, chunk: int = KV_CHUNK) -> tuple[float, int]:
    """window_nll through a compiled step model: each window is one sequence in a fresh paged cache, prefilled
    `chunk` tokens per step; every step's logits for all its tokens are returned and scored."""
    block = step.block_size
    cache = allocate_kv_cache(step, num_blocks=-(-window // block), block_size=block)
    dev = step.device
    total, count = 0.0, 0
    for lo in range(0, len(ids) - 1, window):
        seq = ids[lo:lo + window]
        if len(seq) < 2:
            break
        table = torch.arange(cache.num_blocks, dtype=torch.int32, device=dev)[None]
        logits = []
        for start in range(0, len(seq), chunk):
            end = min(start + chunk, len(seq))
            n = end - start
            pos = torch.arange(start, end, device=dev)
            batch = StepBatch(tokens=torch.tensor(seq[start:end], device=dev), positions=pos, slot_mapping=pos,
                              block_tables=table, context_lens=torch.tensor([end], dtype=torch.int32, device=dev),
                              query_start_loc=torch.tensor([0, n], dtype=torch.int32, device=dev),
                              sample_indices=torch.arange(n, device=dev), max_query_len=n, max_context_len=end)
            logits.append(step(batch, cache))
        logp = torch.log_softmax(torch.cat(logits)[:-1], dim=-1)
        target = torch.tensor(seq[1:], device=logp.device)
        total -= logp.gather(1, target[:, None]).sum().item()
        count += len(seq) - 1
    return total, count


def plan_variants(variants: list[str] | None, cfg, weights=None,
                  defaults: tuple[str, ...] | None = None) -> tuple[list[str], list[str]]:
    """(the variants to run, notes) checked against the model's shapes before anything slow runs.

    variants=None means `defaults` (None: DEFAULT_VARIANTS, read at call time): one that cannot apply to this
    model (an int4 group that does not divide every K) runs with the largest group that does instead, or is skipped
    when that one is already listed or none fits; either way a note says so. A variant named explicitly that cannot
    apply is a KilnError.
    """
    explicit = variants is not None
    gguf = is_gguf(weights)
    names = list(variants if explicit else defaults if defaults is not None else DEFAULT_VARIANTS)
    out: list[str] = []
    notes: list[str] = []
    for v in names:
        if v in DTYPES or v in _KV_VARIANTS:
            out.append(v)
            continue
        if v == "gguf":
            if not gguf:
                raise KilnError(f"variant gguf keeps a GGUF's own quantized tensors; --weights {weights} is not a "
                                ".gguf")
            out.append(v)
            continue
        try:
            scheme, note = resolve_group(parse_scheme(v), cfg)
        except KilnError as e:
            raise KilnError(f"--variants: {v!r} is not a variant ({e}); give fp32, bf16, fp16, gguf, kv-int8, "
                            "kv-auto or a quantization scheme such as int8 or int4-gptq-g64") from None
        quantized = quantized_weights(cfg, lm_head=scheme.lm_head, embeddings=scheme.embeddings)
        bad = next(((n, s[1]) for n, s in quantized.items() if scheme.bits == 4 and s[1] % scheme.group), None)
        if bad is None:
            notes += [f"{v}: {note}"] if note else []
            out.append(v)
            continue
        fits = fitting_group([s[1] for s in quantized.values()])
        why = f"{bad[0]} has K = {bad[1]}, not a multiple of {scheme.group}"
        if explicit:
            hint = f"use group {fits} (e.g. {v.replace(f'-g{scheme.group}', f'-g{fits}')})" if fits else "use int8"
            raise KilnError(f"--variants {v}: cannot apply to {cfg.name}: {why}; {hint}")
        instead = v.replace(f"-g{scheme.group}", f"-g{fits}") if fits else None
        if instead is None or instead in names or instead in out:
            notes.append(f"skipping {v}: {why}" + (f" ({instead} runs anyway)" if instead else ""))
        else:
            notes.append(f"{v} cannot apply ({why}); running {instead} instead")
            out.append(instead)
    return out, notes


def _variant_model(spec, weights, variant: str, device: str, calibration: str | None = None):
    gguf = is_gguf(weights)
    if variant in DTYPES or variant in _KV_VARIANTS:
        dtype = "fp32" if variant in _KV_VARIANTS else variant
        return load_model(spec, weights, dtype=dtype, device=device, quantize="none" if gguf else None)
    if variant == "gguf":
        if not gguf:
            raise KilnError(f"variant gguf keeps a GGUF's own quantized tensors; --weights {weights} is not a .gguf")
        return load_model(spec, weights, dtype="fp32", device=device, quantize="gguf")
    scheme = parse_scheme(variant, **({"calibration": str(calibration)} if calibration else {}))
    m = load_model(spec, weights, dtype="fp32", device=device, quantize="none" if gguf else None)
    m.gm = quantize_graph(m.gm, resolve_group(scheme, m.model)[0], tokenizer=m.tokenizer)
    return m


def run_perplexity(spec, weights, text_path: str | Path, *, variants: list[str] | None = None,
                   window: int | None = None, max_tokens: int | None = None, device: str = "auto",
                   calibration: str | None = None, progress=None, result: dict | None = None) -> dict:
    """Perplexity of every variant on the text; the result dict that `kiln bench perplexity` prints / writes.

    variants: None for DEFAULT_VARIANTS (see plan_variants: those that cannot apply are adapted or skipped, with a
    note in result["notes"]). window: None for DEFAULT_WINDOW capped to the model's context (a longer one is a
    KilnError). max_tokens: None scores the whole text. result: a dict to fill in place, so that a caller keeps the
    finished variants when a later one fails."""
    weights = weights if weights is not None else bundled_weights(spec)
    path = Path(text_path)
    if not path.is_file():
        raise KilnError(f"--text {path}: no such file; give a UTF-8 text file (e.g. bench/data/*.txt)")
    if max_tokens is not None and max_tokens < 2:
        raise KilnError(f"--max-tokens {max_tokens}: give at least 2 tokens (leave it out to score the whole text)")
    check_full_precision(weights, "bench perplexity")
    cfg = describe_model(spec, weights)
    window, window_note = fit_window(window, cfg.context, "--window", DEFAULT_WINDOW)
    variants, notes = plan_variants(variants, cfg, weights)  # before any slow work
    notes = [window_note, *notes] if window_note else notes
    if calibration is not None:
        read_text_file("--calibration", str(calibration))  # not UTF-8: fail now, not after the other variants
        if not any(v.startswith("int4-gptq") for v in variants):
            notes.append("--calibration is not used: no GPTQ variant runs")
    for note in notes:
        if progress:
            progress(f"note: {note}")
    text = read_text_file("--text", str(path))
    result = {} if result is None else result
    result.update({"spec": str(spec), "weights": None if weights is None else str(weights), "text": str(path),
                   "text_bytes": len(text.encode()),
                   "window": window, "calibration": str(calibration) if calibration else "seeded random tokens",
                   "variants": {}, **({"notes": notes} if notes else {})})
    ids: list[int] | None = None
    for variant in variants:
        result["running"] = variant  # named as the failed one if it raises
        t0 = time.perf_counter()
        m = _variant_model(spec, weights, variant, device, calibration)
        if ids is None:
            ids = m.tokenizer.encode(text)[:max_tokens]
            if len(ids) < 2:
                raise KilnError(f"--text {path}: {len(ids)} token(s); perplexity needs at least 2: give a longer "
                                "text")
            result["tokens"] = len(ids)
        if variant in _KV_VARIANTS:
            # reference ops off CUDA: Triton's interpreter is for testing codegen, far too slow to score text
            step = compile_step(m.gm, m.model, m.compile, device=m.device, use_kernels=m.device.type == "cuda",
                                kv_cache_dtype=_KV_VARIANTS[variant])
            nll, n = step_window_nll(step, ids, window)
        else:
            nll, n = window_nll(m.gm, ids, window)
        ppl = math.exp(nll / n)
        result["variants"][variant] = {"perplexity": ppl, "nll_per_token": nll / n, "scored_tokens": n,
                                       "seconds": time.perf_counter() - t0}
        result["model"] = m.model.name
        result.update(run_metadata(m.device))  # device name, torch / triton / cuda versions, commit, date
        if progress:
            progress(f"{variant}: perplexity {ppl:.4f} over {n} tokens ({time.perf_counter() - t0:.0f}s)")
        del m
        del result["running"]
    add_vs_fp32(result)
    return result


def add_vs_fp32(result: dict) -> None:
    """Each variant's perplexity relative to fp32's, when fp32 ran."""
    base = result.get("variants", {}).get("fp32")
    if base:
        for v in result["variants"].values():
            v["vs_fp32"] = v["perplexity"] / base["perplexity"] - 1


def format_perplexity(result: dict) -> str:
    lines = [f"{result.get('model', result['spec'])} on {result['text']} ({result.get('tokens', 0)} tokens, windows "
             f"of {result['window']}, {result.get('device', 'no device')})",
             f"{'variant':<16} {'perplexity':>11} {'vs fp32':>9}"]
    for name, v in result["variants"].items():
        rel = f"{v['vs_fp32'] * 100:+.2f}%" if "vs_fp32" in v else "-"
        lines.append(f"{name:<16} {v['perplexity']:>11.4f} {rel:>9}")
    if result.get("failed"):
        lines.append(f"{result['failed']['variant']:<16} failed: {result['failed']['error']}")
    return "\n".join(lines)


def bench_perplexity_main(args) -> int:
    variants = [v for v in args.variants.split(",") if v] if args.variants else None
    result: dict = {}
    try:
        run_perplexity(args.spec, args.weights, args.text, variants=variants, window=args.window,
                       max_tokens=args.max_tokens, device=args.device, calibration=args.calibration,
                       progress=say, result=result)
    except BaseException as e:  # a later variant failed (or ^C): keep what the earlier ones measured, then re-raise
        if not result.get("variants"):
            raise
        add_vs_fp32(result)
        failed = result.pop("running", "?")
        result["failed"] = {"variant": failed, "error": str(e).splitlines()[0] if str(e) else type(e).__name__}
        say(f"{failed} failed; the {len(result['variants'])} variant(s) that finished follow")
        _emit(args, result, say)
        raise
    _emit(args, result, say)
    return 0


def _emit(args, result: dict, say) -> None:
    print(json.dumps(result, indent=2) if args.json else format_perplexity(result))
    if args.output:
        Path(args.output).parent.mkdir(parents=True, exist_ok=True)
        Path(args.output).write_text(json.dumps(result, indent=2) + "\n")
        say(f"wrote {args.output}")
