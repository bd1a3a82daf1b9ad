"""Value checks shared by spec validation (validate.py, validate_compile.py).

Each check records a Diagnostic on the report at the offending node and returns None, so validation carries on
and every problem of a file is reported together.
"""

from __future__ import annotations

import difflib
import math

from kiln.errors import Diagnostic
from kiln.spec.ast import Bool, Call, Expr, Name, Num, Setting, SpecFile
from kiln.spec.formatter import format_expr


class _Report:
    def __init__(self, spec: SpecFile):
        self.spec, self.diags = spec, []
        self._lines: list[str] | None = None  # the source split once: diagnostics stay linear in file size
        self._seen: set[tuple[int, int, str]] = set()

    def error(self, node, message: str, hint: str = "") -> None:
        line, col = node.span.line, node.span.column
        if (line, col, message) in self._seen:  # e.g. `x * x * x`: the inner product starts where the outer does
            return
        self._seen.add((line, col, message))
        self.diags.append(Diagnostic(self.spec.path, line, col, message, hint, self._source_line(line)))

    def _source_line(self, line: int) -> str:
        if self._lines is None:
            self._lines = self.spec.source.split("\n")  # by "\n" only, as lark counts lines
        return self._lines[line - 1].rstrip("\r") if 0 < line <= len(self._lines) else ""


def _suggest(word: str, choices) -> str:
    """"; did you mean `x`?" for the closest choice, never `word` itself (a known word refused in this place)."""
    close = difflib.get_close_matches(word, [c for c in choices if c != word], n=1)
    return f"; did you mean `{close[0]}`?" if close else ""


def _unique(r: _Report, settings, what: str, known, planned: dict | None = None) -> dict[str, Setting]:
    """Known settings by key; duplicates, reserved and unknown keys are reported."""
    seen: dict[str, Setting] = {}
    for s in settings:
        if s.key in seen:
            r.error(s, f"duplicate {what} `{s.key}` (first set on line {seen[s.key].span.line})",
                    "remove one of the two")
        elif planned and s.key in planned:  # a key that belongs elsewhere: planned maps it to (message, hint)
            r.error(s, *planned[s.key])
        elif s.key not in known:
            r.error(s, f"unknown {what} `{s.key}`{_suggest(s.key, known)}", f"{what}s are: {', '.join(known)}")
        else:
            seen[s.key] = s
    return seen


# ---- values ----------------------------------------------------------------------------------------------


def _int(r: _Report, e: Expr, name: str, hi: int | None = None, why: str = "") -> int | None:
    """A positive integer, at most `hi` (`why` says where that bound comes from)."""
    if isinstance(e, Num) and type(e.value) is int and e.value > 0:
        if hi is None or e.value <= hi:
            return e.value
        value = str(e.value) if e.value < 10**30 else f"a {len(str(e.value))}-digit number"
        r.error(e, f"{name} = {value} is above the largest kiln can build, {hi}", why or f"use {name} <= {hi}")
        return None
    if name == "window":
        hint = "window is how many recent positions each query sees, itself included; omit it for full attention"
    elif isinstance(e, Num) and type(e.value) is int:
        hint = f"{name} counts something, so it is at least 1"
    else:
        hint = f"write a whole number, e.g. {name} = 8"
    r.error(e, f"{name} must be a positive integer, got {format_expr(e)}", hint)
    return None


def _float(r: _Report, e: Expr, name: str, hi: float | None = None, why: str = "") -> float | None:
    """A positive finite number, at most `hi` (`why` says where that bound comes from)."""
    if isinstance(e, Num) and not isinstance(e.value, bool) and e.value > 0:
        try:
            value = float(e.value)
        except OverflowError:  # an integer beyond the float range
            value = math.inf
        if math.isfinite(value) and (hi is None or value <= hi):
            return value
        if math.isfinite(value):
            r.error(e, f"{name} = {value:g} is above the largest kiln accepts, {hi:g}", why)
            return None
        r.error(e, f"{name} is too large to be a finite number (above 1.7e308)",
                f"{name} must be a finite number, e.g. {name} = 1e-5 or {name} = 10000")
        return None
    r.error(e, f"{name} must be a positive number, got {format_expr(e)}", f"e.g. {name} = 1e-5 or {name} = 10000")
    return None


def _bool(r: _Report, e: Expr, name: str) -> bool | None:
    if isinstance(e, Bool):
        return e.value
    r.error(e, f"{name} must be true or false, got {format_expr(e)}", f"write {name} = true or {name} = false")
    return None


def _enum(r: _Report, e: Expr, name: str, label: str, choices) -> str | None:
    if isinstance(e, Name) and e.id in choices:
        return e.id
    hint = f"{name} is one of: {', '.join(choices)}"
    if isinstance(e, Name):
        r.error(e, f"unknown {label} `{e.id}`{_suggest(e.id, choices)}", hint)
    else:
        r.error(e, f"{name} must be one of {', '.join(choices)}, got {format_expr(e)}", hint + " (no quotes)")
    return None


def _kwargs(r: _Report, call: Call, allowed, required=()) -> dict[str, Expr]:
    """Keyword arguments of `call` by name; unknown, duplicate and missing ones are reported."""
    out: dict[str, Expr] = {}
    for kw in call.kwargs:
        if kw.name in out:
            r.error(kw, f"duplicate argument `{kw.name}` to {call.func}()", "remove one of the two")
        elif kw.name not in allowed:
            takes = f"{call.func}() takes: {', '.join(allowed)}" if allowed else f"{call.func}() takes no arguments"
            r.error(kw, f"unknown argument `{kw.name}` to {call.func}(){_suggest(kw.name, allowed)}", takes)
        else:
            out[kw.name] = kw.value
    for name in required:
        if name not in out:
            r.error(call, f"{call.func}() needs `{name} = ...`", f"{call.func}() takes: {', '.join(allowed)}")
    return out


def _config_call(r: _Report, e: Expr, name: str, funcs: dict[str, tuple[str, ...]], example: str):
    """A structured value like rms(eps = 1e-5) -> (func, kwargs), or None; a bare name is a call with no args."""
    call = Call(e.id, span=e.span) if isinstance(e, Name) else e
    if not isinstance(call, Call):
        r.error(e, f"{name} must be a call like {example}, got {format_expr(e)}", f"e.g. {name} = {example}")
        return None
    if call.func not in funcs:
        r.error(call, f"unknown {name} `{call.func}`{_suggest(call.func, funcs)}",
                f"{name} is one of: {', '.join(f'{f}(...)' for f in funcs)}")
        return None
    for arg in call.args:
        r.error(arg, f"{call.func}() takes keyword arguments only", f"e.g. {name} = {example}")
    return call.func, _kwargs(r, call, funcs[call.func])
