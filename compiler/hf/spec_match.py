"""A spec given beside a checkpoint: does it compute what the checkpoint's config says, sizes included (the weight
loader checks the tensors against the spec, so a wrong size would read as a fault of the checkpoint)?"""

from __future__ import annotations

import math

from kiln.errors import KilnError
from kiln.model_config import AttentionCall, MlpCall, ModelConfig, RopeConfig

# The sizes the tensors' shapes follow, then how the projections split into heads (4 heads of 16 have the shapes of 8
# of 8). The weight loader would refuse a wrong size too, but naming only tensors, as if the checkpoint were at fault.
_SIZE_FIELDS = ("vocab", "dim", "layers", "heads", "kv_heads", "head_dim")


def _close(a: float, b: float) -> bool:
    return math.isclose(a, b, rel_tol=1e-6)  # config.json floats may come rounded through float32


def _rope_words(rope: RopeConfig | None) -> dict[str, object]:
    if rope is None:
        return {"rope": "none"}
    out: dict[str, object] = {"rope": "rope", "rope theta": rope.theta}
    s = rope.scaling
    out["rope scaling"] = "none" if s is None else s.kind
    if s is not None:
        out["rope scaling factor"] = s.factor
        if s.kind == "llama3":  # linear reads its factor only
            out |= {"rope scaling low": s.low_freq_factor, "rope scaling high": s.high_freq_factor,
                    "rope scaling original": s.original_context}
    return out


def _site_words(cfg: ModelConfig, context: int) -> dict[str, object]:
    out: dict[str, object] = {}
    for e in cfg.sites():
        if isinstance(e, AttentionCall):
            # a window that spans the served context masks nothing (Mistral's 4096 served at 4096 is no window)
            window = "none" if e.window is None or e.window >= context else e.window
            out |= {f"{e.site} window": window, f"{e.site} causal": e.causal, f"{e.site} qkv_bias": e.qkv_bias,
                    f"{e.site} out_bias": e.out_bias, f"{e.site} qk_norm": e.qk_norm or "none"}
            if cfg.positions == "rope":  # the flag means nothing with learned or no positions
                out[f"{e.site} rope"] = e.rope
        elif isinstance(e, MlpCall):
            out |= {f"{e.site} act": e.act, f"{e.site} bias": e.bias}
    return out


def _words(cfg: ModelConfig, context: int) -> dict[str, object]:
    """What a model computes, by field, as a checkpoint's config.json fixes it. Not compared: the name, the context
    (a spec may serve a shorter one, or extrapolate rope) unless positions are learned (one table row per position),
    and `route` (Mixture-of-Depths routers are a spec's addition, their weights stored beside the checkpoint's)."""
    out: dict[str, object] = {k: getattr(cfg, k) for k in _SIZE_FIELDS}
    if any(isinstance(e, MlpCall) for e in cfg.sites()):
        out["ffn"] = cfg.ffn
    out |= {"norm": cfg.norm.kind, "norm eps": cfg.norm.eps, "positions": cfg.positions}
    if cfg.positions == "learned":
        out["context"] = cfg.context  # the rows of the position table
    out |= {"tie_embeddings": cfg.tie_embeddings, "final_norm": cfg.final_norm}
    return out | _rope_words(cfg.rope if cfg.positions == "rope" else None) | _site_words(cfg, context)


def _shown(v: object) -> str:
    return str(v).lower() if isinstance(v, bool) else f"{v:g}" if isinstance(v, float) else str(v)


def check_spec_matches(spec: ModelConfig, checkpoint: ModelConfig, spec_source: str, config_source: str) -> None:
    """KilnError naming every field where a spec given with a checkpoint computes something else than the
    checkpoint's config (its config.json, a GGUF's metadata, a `kiln quantize` output's spec.kiln) says (a window, a
    rope theta, an eps...): those run without any shape error, so they would give wrong tokens silently."""
    # Windows compare at the context the spec serves: one that spans it masks nothing, but a spec that serves beyond
    # the checkpoint's context must keep the checkpoint's window, however long that context is.
    have, want = _words(spec, spec.context), _words(checkpoint, spec.context)
    diffs, differ = [], []
    for key in dict.fromkeys([*want, *have]):
        # rope theta when one side has no rope at all, the position table's rows when one has none, ...
        if any(key.startswith(k + " ") for k in differ) or (key == "context" and "positions" in differ):
            continue
        a, b = have.get(key, "none"), want.get(key, "none")
        same = _close(a, b) if isinstance(a, float) and isinstance(b, float) else a == b
        if not same:
            differ.append(key)
            diffs.append(f"{key}: {_shown(a)} in the spec, {_shown(b)} in the checkpoint")
    if diffs:
        raise KilnError(f"{spec_source} does not describe the checkpoint {config_source}: " + "; ".join(diffs)
                        + "; fix the spec (`kiln import` of the checkpoint writes a matching one), or leave the "
                        "spec out to read the model from the checkpoint")
