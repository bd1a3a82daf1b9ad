"""The `speculation` setting -> kiln.model_config.SpeculationConfig, from any of the places it can be written.

    compile { speculation = ngram(n = 3, k = 4) }           # the spec file's compile block
    kiln run --speculation "self(layers = 2, k = 4)"        # the flag (same syntax; `off` overrides the spec's key)
    LLM(..., speculation={"kind": "draft", "spec": "tiny-llama", "k": 4})   # the Python API: text, dict or config

Every form goes through the same validation with the spec language's positions: a spec file's errors point at
file:line:col, a flag's into the flag's text. k is 1..K_MAX; n >= 1; self's layers 1 <= L < the model's layers
(checked here when the model is known, i.e. in a spec file; `check_layers` checks a flag's against the loaded
model); draft takes `spec` and/or `weights`, strings, which a spec file resolves relative to itself (like
quantize's calibration file).
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from pathlib import Path

from kiln.errors import SpecError, UsageError
from kiln.model_config import ModelConfig, SpeculationConfig
from kiln.spec.ast import Call, Expr, Name, Str
from kiln.spec.formatter import format_expr
from kiln.spec.parser import parse_expr
from kiln.spec.values import _config_call, _int, _Report, _suggest

# Why a routed model (route = mod(...)) gets no drafter: kiln check, the flags and the draft-model check say it alike.
NOT_FOR_MOD = ("speculative decoding is not built for Mixture-of-Depths models (its rejected drafts would have to be "
               "taken back out of every routed layer's cache)")

K_MAX = 16  # drafted tokens per step at most: acceptance decays geometrically, and the verifier's chunk grows with k
FUNCS = {"ngram": ("n", "k"), "self": ("layers", "k"), "draft": ("spec", "weights", "k")}
OFF = "off"
EXAMPLE = "ngram(n = 3, k = 4)"
_DRAFTERS = 'ngram(n = 3, k = 4), self(layers = L, k = 4), draft(spec = "...", weights = "...", k = 4)'
_KINDS = f"{_DRAFTERS}, or off"
_K_WHY = (f"k is the tokens drafted per step, at most {K_MAX}: each costs a draft step and widens the verification "
          "chunk, while the chance that all are accepted shrinks with every one; 2 to 8 is usual")


@dataclass(frozen=True)
class _Text:
    """What _Report needs of a source: its name and its text (a flag's or an argument's, not a file's)."""

    path: str
    source: str


def speculation_value(r: _Report, e: Expr, *, base_dir: Path | None = None,
                      model_layers: int | None = None) -> SpeculationConfig | None:
    """Validate one speculation value; None for `off` or when an error was reported (r.diags says which).

    base_dir: where relative draft paths start (a spec file's directory; None keeps them as written).
    model_layers: the target's layer count, which self(layers = L) must stay below (None: not known here).
    """
    if isinstance(e, Name) and e.id == OFF:
        return None
    if isinstance(e, Call) and e.func == OFF:  # `off()`, as any bare name is its call (and the dict {"kind": "off"})
        if e.args or e.kwargs:
            r.error(e, "off takes no settings: it turns speculation off", f"write `off` alone (or leave speculation "
                    f"out), or pick a drafter: {_DRAFTERS}")
        return None
    func = e.id if isinstance(e, Name) else e.func if isinstance(e, Call) else None
    if func is not None and func not in FUNCS:
        r.error(e, f"unknown speculation `{func}`{_suggest(func, (*FUNCS, OFF))}", f"speculation is one of: {_KINDS}")
        return None
    found = _config_call(r, e, "speculation", FUNCS, EXAMPLE)
    if found is None:
        return None
    kind, kw = found
    call = e if isinstance(e, Call) else None
    ok = True
    out: dict = {"kind": kind}
    if "k" in kw:
        out["k"] = _int(r, kw["k"], "k", K_MAX, _K_WHY)
    if "n" in kw:
        out["n"] = _int(r, kw["n"], "n", None)
    if kind == "self":
        if "layers" not in kw:
            r.error(call or e, "self() needs `layers = ...`",
                    "the self drafter runs the target's first L layers and its head, e.g. self(layers = 2, k = 4)")
            ok = False
        else:
            out["layers"] = layers = _int(r, kw["layers"], "layers", None)
            if layers is not None and model_layers is not None and layers >= model_layers:
                r.error(kw["layers"], f"self(layers = {layers}) must use fewer layers than the model's {model_layers}",
                        _layers_hint(model_layers))
                ok = False
    if kind == "draft":
        if "spec" not in kw and "weights" not in kw:
            r.error(call or e, "draft() needs `spec = ...` and/or `weights = ...`",
                    'name the draft model, e.g. draft(spec = "tiny-llama", weights = "draft-checkpoint/", k = 4)')
            ok = False
        for key in ("spec", "weights"):
            if key in kw:
                out[key] = _path(r, kw[key], key, base_dir)
    if not ok or None in out.values():
        return None
    return SpeculationConfig(**out)


def _layers_hint(model_layers: int) -> str:
    if model_layers < 2:
        return "a one-layer model has no shorter self drafter; use ngram(...) or draft(...)"
    return (f"the self drafter runs the target's first L layers and its head: 1 <= L < {model_layers}, "
            f"e.g. layers = {max(1, model_layers // 4)}")


def _path(r: _Report, e: Expr, key: str, base_dir: Path | None) -> str | None:
    if not (isinstance(e, Str) and e.value):
        example = 'spec = "tiny-llama" (a spec file or bundled spec)' if key == "spec" else 'weights = "draft-dir/"'
        r.error(e, f"{key} must be a file or directory name in quotes, got {format_expr(e)}", f"e.g. {example}")
        return None
    path = Path(e.value)
    if base_dir is None or path.is_absolute():
        return e.value
    near = base_dir / path  # relative to the spec file, like quantize's calibration file
    if key == "spec" and not near.exists() and len(path.parts) == 1 and path.suffix != ".kiln":
        return e.value  # a bare name with no file beside the spec: a bundled spec, looked up when loaded
    return str(near)


def parse_speculation(text: str, source: str = "--speculation") -> SpeculationConfig | None:
    """A flag's or argument's text in the spec syntax (`ngram(n = 3, k = 4)`), or `off` -> None; a SpecError
    pointing into `text` (shown as `source`) otherwise. Relative draft paths stay relative to the working
    directory."""
    if text.strip() == OFF:
        return None
    e = parse_expr(text, source)
    r = _Report(_Text(source, text))  # type: ignore[arg-type]  (a report needs only the path and the text)
    cfg = speculation_value(r, e)
    if r.diags:
        raise SpecError(r.diags)
    return cfg


def speculation_config(value: object, source: str = "speculation") -> SpeculationConfig | None:
    """LLM(speculation=...): a SpeculationConfig, its text (`ngram(n = 3, k = 4)`), a dict of its fields
    ({"kind": "ngram", "n": 3, "k": 4}; {"kind": "off"} is off too) or None / "off" (no speculation). Each is
    validated the same way."""
    if value is None:
        return None
    if isinstance(value, str):
        return parse_speculation(value, source)
    if isinstance(value, SpeculationConfig):
        keep = {f.name for f in dataclasses.fields(value) if f.name in FUNCS.get(value.kind, ())}
        value = {"kind": value.kind} | {k: getattr(value, k) for k in keep if getattr(value, k) != ""}
    if not isinstance(value, dict):
        raise UsageError(f"{source} must be a SpeculationConfig, text like {EXAMPLE!r}, a dict like "
                         f"{{'kind': 'ngram', 'n': 3, 'k': 4}}, or None / 'off'; got {type(value).__name__}")
    return parse_speculation(_dict_text(value, source), source)


def _dict_text(d: dict, source: str) -> str:
    """The dict as the equivalent text, so it is validated (and its errors shown) like the text form."""
    kind = d.get("kind")
    if not isinstance(kind, str) or not kind.isidentifier():
        raise UsageError(f"{source}: the dict needs 'kind', one of {', '.join(FUNCS)} or {OFF!r}; got {kind!r}")
    parts = []
    for key, v in d.items():
        if key == "kind":
            continue
        if not isinstance(key, str) or not key.isidentifier():
            raise UsageError(f"{source}: key {key!r} is not a setting name; {kind}() takes "
                             f"{', '.join(FUNCS.get(kind, ())) or 'no settings'}")
        if isinstance(v, bool):
            lit = "true" if v else "false"
        elif isinstance(v, (int, float, str)):
            lit = json.dumps(v, ensure_ascii=False) if isinstance(v, str) else repr(v)
        else:
            raise UsageError(f"{source}[{key!r}] = {v!r}: values are numbers or strings, e.g. {{'kind': 'ngram', "
                             "'n': 3, 'k': 4}")
        parts.append(f"{key} = {lit}")
    return f"{kind}({', '.join(parts)})"


def check_layers(cfg: SpeculationConfig, model: ModelConfig, source: str = "--speculation") -> None:
    """A self drafter given by flag or argument must stay below the loaded model's layers (a spec file's key is
    checked at validation, where the model is known)."""
    if cfg.kind == "self" and cfg.layers >= model.layers:
        raise UsageError(f"{source} {describe(cfg)}: the self drafter must use fewer layers than the "
                         f"{model.layers} of model {model.name!r}; {_layers_hint(model.layers)}")


def describe(cfg: SpeculationConfig) -> str:
    """The config in the spec syntax, with only its kind's fields: `self(layers = 2, k = 4)`."""
    fields = [k for k in FUNCS[cfg.kind] if getattr(cfg, k) not in ("", None)]
    return f"{cfg.kind}({', '.join(f'{k} = {json.dumps(getattr(cfg, k))}' for k in fields)})"
