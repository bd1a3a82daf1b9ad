"""The quality report: how far each quantization scheme moves a model's logits from the unquantized model's.

For every scheme the same evaluation tokens (256 positions by default, seeded, or from a text file) go
through the unquantized graph and through a quantized copy, on the reference ops, and the report gives
- rel_logit_error: ||L_q - L||_F / ||L||_F over all positions (fp32 logits);
- top1_agreement: the share of positions whose argmax token is the same;
- weight_bytes and bytes_ratio against the unquantized graph.
GPTQ schemes calibrate on their own tokens (seeded differently from the evaluation tokens, or a text file).
`kiln bench quality` prints it: bench_quality_main returns the dict, format_quality renders the table.
"""

from __future__ import annotations

import copy
import json as jsonlib
import math
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, replace
from typing import TextIO

import torch
from torch import fx

from kiln.build import describe_model, load_model, say
from kiln.cli.perplexity import check_full_precision, plan_variants
from kiln.cli.text_input import read_text_file
from kiln.compile.pipeline import quantize_graph
from kiln.errors import KilnError
from kiln.gguf.files import bundled_weights, is_gguf
from kiln.ir.text import weight_bytes
from kiln.quant.formats import QuantScheme, as_scheme
from kiln.quant.sizing import resolve_group
from kiln.reference import forward_logits, vocab_size
from kiln.run_info import run_metadata

DEFAULT_SCHEMES = ("int8", "int4-rtn-g128", "int4-gptq-g128")
EVAL_SEED = 12345  # differs from QuantScheme.seed, so GPTQ never calibrates on the evaluation tokens


@dataclass
class QualityRow:
    scheme: str
    rel_logit_error: float | None = None
    top1_agreement: float | None = None
    weight_bytes: int | None = None
    bytes_ratio: float | None = None
    quantize_s: float | None = None
    perplexity: float | None = None  # of the evaluation tokens (meaningful on real text: --eval-text)
    error: str | None = None  # the scheme cannot apply to this model (e.g. K not a multiple of the group)


def weight_breakdown(gm: fx.GraphModule) -> dict[str, int]:
    """Bytes of a (quantized) graph's tensors: quantized codes, their scales and zeros, dense tensors, total.

    The total equals kiln.ir.text.weight_bytes(gm): quantized tensors are buffers, which it counts.
    """
    out = {"quantized": 0, "scales_zeros": 0, "dense": 0}
    seen: set[int] = set()
    for name, t in list(gm.named_parameters()) + list(gm.named_buffers()):
        if id(t) in seen:
            continue
        seen.add(id(t))
        kind = (
            "quantized"
            if name.endswith(".qweight")
            else "scales_zeros"
            if name.endswith((".scales", ".zeros"))
            else "dense"
        )
        out[kind] += t.numel() * t.element_size()
    out["total"] = weight_bytes(gm)
    return out


def eval_ids(vocab: int, positions: int = 256, seq_len: int = 64, *, text: str | None = None, tokenizer=None):
    """Evaluation token ids [rows, seq_len] with rows * seq_len == positions: seeded random, or from text."""
    if positions % seq_len:
        raise KilnError(f"quality: positions ({positions}) must be a multiple of seq_len ({seq_len})")
    if text is not None:
        ids = (tokenizer.encode(text) if tokenizer is not None else list(text.encode("utf-8")))[:positions]
        if len(ids) < positions:
            raise KilnError(f"quality: the evaluation text has {len(ids)} tokens; {positions} are needed")
        return torch.tensor(ids, dtype=torch.long).view(-1, seq_len)
    gen = torch.Generator().manual_seed(EVAL_SEED)
    return torch.randint(0, vocab, (positions // seq_len, seq_len), generator=gen)


def compare_logits(ref: torch.Tensor, got: torch.Tensor) -> tuple[float, float]:
    """(relative Frobenius error, top-1 agreement) of logits `got` against `ref` ([..., vocab])."""
    ref, got = ref.float(), got.float()
    rel = ((got - ref).norm() / ref.norm().clamp(min=1e-30)).item()
    agree = (got.argmax(-1) == ref.argmax(-1)).float().mean().item()
    return rel, agree


def perplexity(logits: torch.Tensor, ids: torch.Tensor) -> float:
    """exp of the mean next-token negative log-likelihood of ids [B, T] under logits [B, T, vocab]."""
    nll = torch.nn.functional.cross_entropy(logits[:, :-1].float().flatten(0, 1), ids[:, 1:].flatten())
    return math.exp(nll.item())


def quality_report(
    gm: fx.GraphModule,
    schemes: Sequence[QuantScheme | str] = DEFAULT_SCHEMES,
    *,
    ids: torch.Tensor | None = None,
    positions: int = 256,
    seq_len: int = 64,
    tokenizer=None,
    calibration_ids: torch.Tensor | None = None,
    progress: Callable[[str], None] | None = None,
) -> dict:
    """Quantize a copy of the unquantized Level-1 graph `gm` with each scheme and compare its logits to gm's.

    ids: evaluation tokens [B, T] (default: `positions` seeded random ones in rows of seq_len).
    calibration_ids: tokens for GPTQ (default: each scheme's own, a text file or seeded random).
    """
    ids = eval_ids(vocab_size(gm), positions, seq_len) if ids is None else ids
    base_bytes = weight_bytes(gm)
    reference = forward_logits(gm, ids)
    rows = []
    for s in schemes:
        scheme = as_scheme(s)
        if progress is not None:
            progress(f"quality: {scheme.label}")
        t0 = time.perf_counter()
        try:
            q = quantize_graph(copy.deepcopy(gm), scheme, calibration_ids=calibration_ids, tokenizer=tokenizer)
        except KilnError as e:
            rows.append(QualityRow(scheme.label, error=str(e).splitlines()[0]))
            continue
        seconds = time.perf_counter() - t0
        logits = forward_logits(q, ids)
        rel, agree = compare_logits(reference, logits)
        size = weight_bytes(q)
        rows.append(QualityRow(scheme.label, rel, agree, size, size / base_bytes, seconds, perplexity(logits, ids)))
        del q
    dtype = str(next(iter(gm.parameters())).dtype).removeprefix("torch.")
    return {
        "positions": int(ids.numel()),
        "baseline": {"dtype": dtype, "weight_bytes": base_bytes, "perplexity": perplexity(reference, ids)},
        "rows": [asdict(r) for r in rows],
    }


def format_quality(report: dict) -> str:
    """The report as a plain-text table."""
    head = report.get("model", "model")
    base = report["baseline"]
    lines = [
        f"{head}: {report['positions']} positions, baseline {base['dtype']} {base['weight_bytes'] / 2**20:.2f} MiB, "
        f"perplexity {base['perplexity']:.3f}",
        f"{'scheme':<22}{'rel logit err':>14}{'top-1 agree':>13}{'perplexity':>12}{'weights MiB':>13}{'ratio':>8}"
        f"{'quantize s':>12}",
    ]
    for r in report["rows"]:
        if r["error"]:
            lines.append(f"{r['scheme']:<22}  n/a: {r['error']}")
            continue
        lines.append(
            f"{r['scheme']:<22}{r['rel_logit_error']:>14.4f}{r['top1_agreement']:>13.3f}{r['perplexity']:>12.3f}"
            f"{r['weight_bytes'] / 2**20:>13.2f}{r['bytes_ratio']:>8.3f}{r['quantize_s']:>12.1f}"
        )
    return "\n".join(lines)


def bench_quality_main(
    spec: str | None = None,
    weights: str | None = None,
    *,
    schemes: Sequence[str] | None = None,
    positions: int = 256,
    seq_len: int | None = None,
    eval_text: str | None = None,
    calibration: str | None = None,
    dtype: str | None = None,
    device: str = "auto",
    json: bool = False,
    out: TextIO | None = None,
) -> dict:
    """`kiln bench quality`: load the model (spec and/or HF checkpoint dir, as `kiln run`), report every
    scheme, print the table (or JSON with json=True) to `out` (default stdout) and return the report.

    schemes: None (or exactly DEFAULT_SCHEMES) for the defaults, each adapted to the model's shapes as `bench
    perplexity` adapts its defaults (an int4 group that does not divide every K takes the largest that does, with a
    note); schemes named otherwise that cannot apply are error rows. calibration: a text file for the GPTQ schemes
    (default: seeded random tokens); eval_text: a text file to evaluate on (default: seeded random tokens).
    """
    check_full_precision(weights, "bench quality")  # its baseline must be the unquantized model
    cfg = describe_model(spec, weights)
    seq = seq_len or min(128, cfg.context, positions)
    if positions % seq:
        raise KilnError(f"--positions {positions}: evaluated in rows of {seq} tokens (128 or the model's context, "
                        f"whichever is less); give at most {seq} or a multiple of {seq}")
    if schemes is None or list(schemes) == list(DEFAULT_SCHEMES):
        schemes, notes = plan_variants(None, cfg, defaults=DEFAULT_SCHEMES)
        for note in notes:
            say(f"note: {note}")
    text = read_text_file("--eval-text", eval_text) if eval_text else None
    if calibration is not None:
        read_text_file("--calibration", calibration)  # not UTF-8: fail before the model loads
    source = weights if weights is not None else bundled_weights(spec)
    # A GGUF's Q4 / Q8 linears are dequantized (not kept, as on CUDA): the baseline is the unquantized model.
    gguf = is_gguf(source)
    loaded = load_model(spec, weights, dtype=dtype, device=device, quantize="none" if gguf else None)
    ids = eval_ids(loaded.model.vocab, positions, seq, text=text, tokenizer=loaded.tokenizer if text else None)
    chosen = []
    for s in schemes:  # a scheme without a group gets the one that fits this model
        scheme, note = resolve_group(as_scheme(s), loaded.model)
        if note:
            say(f"note: {note}")
        chosen.append(scheme)
    if calibration is not None:
        chosen = [replace(s, calibration=calibration) if s.method == "gptq" else s for s in chosen]
    report = quality_report(loaded.gm, chosen, ids=ids, tokenizer=loaded.tokenizer, progress=say)
    report = {"model": loaded.model.name, **report, **run_metadata(loaded.device)}
    stream = out if out is not None else sys.stdout
    print(jsonlib.dumps(report, indent=2) if json else format_quality(report), file=stream)
    return report
