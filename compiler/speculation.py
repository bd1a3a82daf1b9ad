"""Speculative decoding's drafter, from a SpeculationConfig and the loaded target (kiln.llm and the CLI use this).

    plan = prepare_drafter(cfg, loaded)            # before the target's compile_step, which rewrites loaded.gm
    target = compile_step(loaded.gm, ...)
    engine = Engine(target, ..., drafter=build_drafter(plan, target))

ngram(n, k) -> NgramDrafter(n, k). self(layers = L) -> the target's first L layers, final norm and head
(passes/speculative.py cuts them from the Level-1 graph, sharing the weights), compiled by the target's own
compile_step path and config (dtype, KV dtype, block size, passes) -> ModelDrafter(step, k,
shares_target_cache=True); after compiling, every draft weight equal to the target's (the fused projections, the
quantized codes) is replaced by the target's tensor, so the self drafter costs no weight memory. draft(spec,
weights) -> the draft model loaded by kiln.build.load_model in the target's dtype and on its device, checked to
share the target's tokenizer, compiled with the target's KV cache settings -> ModelDrafter(step, k, context = the
draft's): a draft model with a shorter context than the target's drafts only the sequences that fit it (a note at load
and at `kiln check` says past how many tokens speculation stops).

The plan compiles the draft step model once; every build_drafter call (one per engine) makes a fresh drafter
over it, as the CLI's benchmark builds one engine per policy over one target step model.
"""

from __future__ import annotations

import dataclasses
import json
import os
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import fx

from kiln.build import LoadedModel, describe_model, load_model, say
from kiln.compile.step import compile_step
from kiln.errors import InternalError, KilnError, UsageError
from kiln.ir.attrs import owner
from kiln.model_config import ModelConfig, SpeculationConfig
from kiln.model_paths import WeightsPathError
from kiln.passes.speculative import self_draft_graph
from kiln.runtime.speculative import ModelDrafter, NgramDrafter
from kiln.spec.speculation import NOT_FOR_MOD, check_layers, describe, speculation_config
from kiln.step import StepModel


@dataclass
class DraftPlan:
    """What build_drafter needs, made before the target is compiled."""

    config: SpeculationConfig
    target: LoadedModel
    graph: fx.GraphModule | None = None  # self: the cut Level-1 graph, compiled on the first build_drafter
    model: ModelConfig | None = None  # self / draft: the draft step model's config
    draft: LoadedModel | None = None  # draft: the loaded draft model
    step: StepModel | None = None  # self / draft: compiled once, on the first build_drafter


def resolve_speculation(value: object, loaded: LoadedModel, source: str = "speculation") -> SpeculationConfig | None:
    """The speculation to use: `value` (a flag's or LLM's: a SpeculationConfig, its text, a dict, or "off") wins over
    the spec's `speculation` key; None takes the spec's. A self drafter is checked against the model's layers."""
    cfg = loaded.compile.extra.get("speculation") if value is None else speculation_config(value, source)
    if cfg is not None:
        if loaded.model.route is not None:
            raise UsageError(f"{source} {describe(cfg)}: {NOT_FOR_MOD}; serve {loaded.model.name} with speculation "
                             "off (--speculation off, LLM(speculation='off'))")
        check_layers(cfg, loaded.model, source)
    return cfg


def check_draft(cfg: SpeculationConfig, target: ModelConfig, spec_file: str | None = None) -> ModelConfig:
    """The draft model's config, read without its weights (a spec, config.json or GGUF metadata), or a KilnError
    saying why it cannot draft for `target` (it cannot be read, it routes layers, its vocabulary differs): found
    before any weight loads, and by `kiln check`. spec_file: the spec whose `speculation` key cfg is (its relative
    paths were resolved from that spec's folder); None for a flag's or an argument's."""
    where = _where(cfg, spec_file)
    weights = Path(cfg.weights) if cfg.weights else None
    if weights is not None and weights.suffix == ".kiln" and weights.is_file():  # model_paths' fix names SPEC
        raise UsageError(f"{where}: weights = {json.dumps(_as_written(cfg.weights, spec_file))} is a spec file, not "
                         "weights; name it as the draft's spec: draft(spec = \"...\", k = ...), with weights only "
                         "for its checkpoint")
    try:
        draft = describe_model(cfg.spec or None, cfg.weights or None)
    except KilnError as e:
        raise UsageError(f"{where}: cannot load the draft model: {_weights_named(e, cfg, spec_file)}") from None
    if draft.route is not None:
        raise UsageError(f"{where}: the draft model {draft.name!r} routes layers (route = mod(...)), and "
                         f"{NOT_FOR_MOD}; use its dense form as the draft")
    if draft.vocab != target.vocab:
        raise UsageError(f"{where}: the draft model {draft.name!r} and the target {target.name!r} have different "
                         f"vocabularies: {draft.vocab} ids in the draft's, {target.vocab} in the target's; "
                         + _SAME_TOKENIZER)
    return draft


def draft_context_note(cfg: SpeculationConfig, draft: ModelConfig, target: ModelConfig) -> str | None:
    """What a draft model with a shorter context than the target's means, or None: not an error (vLLM bounds the
    draft's length the same way), but requests past the draft's context decode without drafts (ModelDrafter.fits)."""
    if cfg.kind != "draft" or draft.context >= target.context:
        return None
    last = draft.context - cfg.k + 1  # the longest sequence that still gets k drafts (ModelDrafter.fits)
    head = (f"the draft model {draft.name!r} takes {draft.context} tokens of context, the target {target.name!r} "
            f"{target.context}")
    if last < 1:
        return (f"{head}: k = {cfg.k} drafts leave no room in it, so nothing is speculated; lower k or give a draft "
                "model with a longer context")
    return (f"{head}: speculation stops once a request passes {last} tokens (the positions of its k = {cfg.k} drafts "
            "must fit the draft's context); longer requests decode without drafts")


def _where(cfg: SpeculationConfig, spec_file: str | None) -> str:
    """How a message names the speculation: as written, and in which spec file when it is a spec's key."""
    if spec_file is None:
        return f"speculation {describe(cfg)}"
    written = dataclasses.replace(cfg, spec=_as_written(cfg.spec, spec_file),
                                  weights=_as_written(cfg.weights, spec_file))
    return f"speculation {describe(written)} in {spec_file}"


def _as_written(path: str, spec_file: str | None) -> str:
    """A spec key's path as its spec wrote it: validation joined a relative one to the spec's folder."""
    folder = Path(spec_file).parent if spec_file is not None else Path(".")
    if not path or folder == Path("."):
        return path
    try:
        return str(Path(path).relative_to(folder))
    except ValueError:  # absolute, or a bundled spec's bare name: kept as it was
        return path


def _weights_named(e: KilnError, cfg: SpeculationConfig, spec_file: str | None) -> str:
    """e's message, with a path check_weights_dir refused named as the speculation's `weights` or `spec` (as written
    and as resolved), not as the --weights flag, which the user may never have given."""
    if not isinstance(e, WeightsPathError):
        return str(e)
    key = next((k for k in ("weights", "spec") if getattr(cfg, k) and Path(getattr(cfg, k)) == e.path), None)
    if key is None:
        return str(e)
    written = _as_written(getattr(cfg, key), spec_file)
    base = "the working directory" if spec_file is None else "the spec's folder"
    how = "" if os.path.isabs(written) else f" (resolved from {base}: {os.path.abspath(e.path)})"
    return f"{key} = {json.dumps(written)}{how}: {e.problem}"


def prepare_drafter(cfg: SpeculationConfig, loaded: LoadedModel, *, seed: int = 0) -> DraftPlan:
    """Cut the self drafter's graph from the target's Level-1 graph, or load the draft model (its tokenizer checked
    against the target's); nothing for n-gram. Call it before compile_step rewrites loaded.gm."""
    if cfg.kind == "ngram":
        return DraftPlan(cfg, loaded)
    if cfg.kind == "self":
        check_layers(cfg, loaded.model, "speculation")
        graph = self_draft_graph(loaded.gm, cfg.layers)
        return DraftPlan(cfg, loaded, graph=graph, model=dataclasses.replace(loaded.model, layers=cfg.layers))
    own_key = cfg is loaded.compile.extra.get("speculation") and loaded.source.endswith(".kiln")
    spec_file = loaded.source if own_key else None  # the spec's key: its paths start at the spec's folder
    check_draft(cfg, loaded.model, spec_file)  # before the draft's weights load
    try:
        draft = load_model(cfg.spec or None, cfg.weights or None, dtype=loaded.compile.dtype,
                           device=str(loaded.device), seed=seed)
    except KilnError as e:  # no such file, a directory, a spec that does not match its weights...: say who named it
        raise UsageError(f"{_where(cfg, spec_file)}: cannot load the draft model: "
                         f"{_weights_named(e, cfg, spec_file)}") from None
    check_same_tokenizer(loaded, draft)
    say(f"draft model {draft.model.name} ({draft.model.layers} layers) from {draft.source}")
    note = draft_context_note(cfg, draft.model, loaded.model)
    if note is not None:
        say(f"note: {note}")
    return DraftPlan(cfg, loaded, model=draft.model, draft=draft)


def compile_draft(plan: DraftPlan, target: StepModel, *, use_kernels: bool | None = None) -> StepModel:
    """The draft step model (compiled on the first call, then reused): with the target's dtype, KV cache dtype and
    block size, on its device."""
    if plan.step is not None:
        return plan.step
    if plan.config.kind == "ngram":
        raise InternalError("compile_draft: an n-gram drafter has no model")
    kv_dtype = "int8" if target.kv_dtype == torch.int8 else "auto"
    use_kernels = getattr(target, "use_kernels", None) if use_kernels is None else use_kernels
    comp = plan.target.compile
    if plan.config.kind == "draft":
        assert plan.draft is not None and plan.model is not None
        own = plan.draft.compile  # its own passes and quantization; the target's dtype and KV cache settings
        extra = {k: v for k, v in own.extra.items() if k not in ("kv_cache", "speculation")}
        if "kv_cache" in comp.extra:
            extra["kv_cache"] = comp.extra["kv_cache"]
        comp = dataclasses.replace(own, dtype=comp.dtype, extra=extra)
        gm = plan.draft.gm
    else:
        assert plan.graph is not None and plan.model is not None
        gm = plan.graph
    step = compile_step(gm, plan.model, comp, device=target.device, use_kernels=use_kernels, kv_cache_dtype=kv_dtype)
    if plan.config.kind == "self" and isinstance(getattr(target, "gm", None), torch.nn.Module):
        share_weights(step.gm, target.gm)
    plan.graph = None  # compiled: the step holds what it needs
    plan.step = step
    return step


def build_drafter(plan: DraftPlan, target: StepModel, *, use_kernels: bool | None = None
                  ) -> NgramDrafter | ModelDrafter:
    """A fresh NgramDrafter or ModelDrafter (kiln.runtime.speculative) for one engine over `target`."""
    cfg = plan.config
    if cfg.kind == "ngram":
        return NgramDrafter(n=cfg.n, k=cfg.k)
    step = compile_draft(plan, target, use_kernels=use_kernels)
    if cfg.kind == "self":  # the target's own layers: its context, which no request passes
        return ModelDrafter(step, cfg.k, shares_target_cache=True)
    assert plan.model is not None
    return ModelDrafter(step, cfg.k, context=plan.model.context)


def share_weights(draft: torch.nn.Module, target: torch.nn.Module) -> int:
    """Point every parameter and buffer of `draft` that equals the target's of the same name at the target's
    tensor; returns how many. The passes after the cut (projection fusion, quantization) make new tensors in
    each model, equal in value, that would otherwise be held twice."""
    theirs = dict(target.named_parameters()) | dict(target.named_buffers())
    shared = 0
    for name, mine in [*draft.named_parameters(), *draft.named_buffers()]:
        other = theirs.get(name)
        if other is None or other is mine:
            continue
        if (other.shape, other.dtype, other.device) != (mine.shape, mine.dtype, mine.device):
            continue
        if not torch.equal(other, mine):
            continue
        mod, leaf = owner(draft, name)
        if leaf in mod._parameters:
            mod._parameters[leaf] = other  # type: ignore[assignment]
        else:
            mod._buffers[leaf] = other
        shared += 1
    return shared


def check_same_tokenizer(target: LoadedModel, draft: LoadedModel) -> None:
    """KilnError unless the draft model scores the target's vocabulary: the same size, and the same token for every
    id (speculation compares token ids and probabilities over them)."""
    t, d = target.model, draft.model
    t_tokens, d_tokens = _tokens(target.tokenizer), _tokens(draft.tokenizer)
    where = f"the draft model {d.name!r} ({draft.source}) and the target {t.name!r} ({target.source})"
    fix = _SAME_TOKENIZER
    if d.vocab != t.vocab:
        raise KilnError(f"{where} have different vocabularies: {d.vocab} ids in the draft's, {t.vocab} in the "
                        f"target's; {fix}")
    if t_tokens is None or d_tokens is None:
        return  # a tokenizer that cannot list its tokens: the sizes are all that can be compared
    for i in range(max(len(t_tokens), len(d_tokens))):
        a = d_tokens[i] if i < len(d_tokens) else None
        b = t_tokens[i] if i < len(t_tokens) else None
        if a != b:
            raise KilnError(
                f"{where} have different tokenizers: token {i} is {_shown(a)} in the draft's vocabulary "
                f"({len(d_tokens)} tokens, {type(draft.tokenizer).__name__}) and {_shown(b)} in the target's "
                f"({len(t_tokens)} tokens, {type(target.tokenizer).__name__}); {fix}")


_SAME_TOKENIZER = ("speculation compares token ids, so the draft model needs the target's tokenizer: use a smaller "
                   "model of the same family, or ngram(...) / self(...)")


def _tokens(tok: object) -> list[str | None] | None:
    table = getattr(tok, "token_strings", None)
    return table() if callable(table) else None


def _shown(token: str | None) -> str:
    return "missing" if token is None else repr(token)
