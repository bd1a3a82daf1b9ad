"""SpecFile AST -> canonical spec text; parse_spec(format_spec(ast)) == ast for every AST.

Canonical form: 2-space indent, one setting per line, `key = value`, keyword arguments `k = v` joined by
", ", floats via repr() (so they read back bit-exact), a blank line around the layer block and between the
model and compile blocks, and a trailing newline. Comments (SpecFile.comments, with the parser's spans) go
back next to their constructs: own-line comments just before the next setting, statement or block (or the
closing brace at the end of a block), at that construct's indent; a comment after code stays on that line,
two spaces after it.
"""

from __future__ import annotations

import json
import math
from bisect import bisect_right
from dataclasses import dataclass, field

from kiln.spec.ast import BinOp, Bool, Call, Comment, Expr, LayerBlock, Name, Num, Span, SpecFile, Str

_PRECEDENCE = {"+": 1, "*": 2}
_ATOM = 3


def _precedence(e: Expr) -> int:
    return _PRECEDENCE[e.op] if isinstance(e, BinOp) else _ATOM


def format_expr(e: Expr) -> str:
    """One expression in canonical form, with parentheses only where precedence or association needs them."""
    if isinstance(e, BinOp):
        p = _precedence(e)
        left, right = format_expr(e.left), format_expr(e.right)
        if _precedence(e.left) < p:
            left = f"({left})"
        if _precedence(e.right) <= p:  # operators are left-associative: a + (b + c) keeps its parentheses
            right = f"({right})"
        return f"{left} {e.op} {right}"
    if isinstance(e, Call):
        parts = [format_expr(a) for a in e.args] + [f"{k.name} = {format_expr(k.value)}" for k in e.kwargs]
        return f"{e.func}({', '.join(parts)})"
    if isinstance(e, Bool):
        return "true" if e.value else "false"
    if isinstance(e, Num):
        if isinstance(e.value, bool) or not isinstance(e.value, (int, float)):
            raise TypeError(f"Num holds {e.value!r}, not a number")
        if isinstance(e.value, float) and not math.isfinite(e.value):
            raise ValueError(f"{e.value} has no spec syntax; numbers must be finite")
        return repr(e.value) if isinstance(e.value, float) else str(e.value)
    if isinstance(e, Str):
        return json.dumps(e.value, ensure_ascii=False)
    if isinstance(e, Name):
        return e.id
    raise TypeError(f"not a spec expression: {e!r}")


Pos = tuple[int, int]  # (line, column); (0, 0) for nodes built in code


@dataclass
class _Line:
    """One output line and the source range it came from, which decides the comments that go with it."""

    text: str  # indented
    note_indent: str  # for comments on their own lines just before it
    start: Pos
    end: Pos  # a comment on this line at or after `end` trails it
    leaf: bool = False  # a setting or assignment, whose source may span lines
    blank_before: bool = False
    notes: list[str] = field(default_factory=list)
    trailing: str = ""


def _pos(span: Span, end: bool = False) -> Pos:
    return (span.end_line, span.end_column) if end else (span.line, span.column)


def _leaf(text: str, indent: str, span: Span, blank_before: bool = False) -> _Line:
    return _Line(indent + text, indent, _pos(span), _pos(span, True), leaf=True, blank_before=blank_before)


def _block(header: str, indent: str, span: Span, body: list[_Line], blank_before: bool = False) -> list[_Line]:
    """A header line (a comment on its first source line trails it), the body, and the closing brace."""
    opening = _Line(indent + header, indent, _pos(span), _pos(span), blank_before=blank_before)
    closing = _Line(indent + "}", indent + "  ", _pos(span, True), _pos(span, True))
    return [opening, *body, closing]


def _lines(spec: SpecFile) -> list[_Line]:
    body: list[_Line] = []
    items = spec.model.items
    for i, item in enumerate(items):
        # A blank line on each side of a layer block.
        blank = i > 0 and (isinstance(item, LayerBlock) or isinstance(items[i - 1], LayerBlock))
        if isinstance(item, LayerBlock):
            assigns = [_leaf(f"{a.target} = {format_expr(a.value)}", "    ", a.span) for a in item.body]
            body += _block("layer {", "  ", item.span, assigns, blank)
        else:
            body.append(_leaf(f"{item.key} = {format_expr(item.value)}", "  ", item.span, blank))
    lines = _block(f"model {json.dumps(spec.model.name, ensure_ascii=False)} {{", "", spec.model.span, body)
    if spec.compile is not None:
        settings = [_leaf(f"{s.key} = {format_expr(s.value)}", "  ", s.span) for s in spec.compile.settings]
        lines += _block("compile {", "", spec.compile.span, settings, blank_before=True)
    return lines


def _place(comments: tuple[Comment, ...], lines: list[_Line]) -> list[str]:
    """Attach each comment to the line it belongs with; returns those that come after everything.

    A comment after code on its line trails the last construct ending there; a comment inside a multi-line
    setting goes just before it; any other goes just before the next construct, or before the closing brace
    at the end of a block. `lines` are in source order, so their starts are sorted.
    """
    starts = [ln.start for ln in lines]
    tail: list[str] = []
    for c in comments:
        at = (c.line, c.column)
        inside = next((ln for ln in lines if ln.leaf and ln.start < at < ln.end), None)
        before = [ln for ln in lines if ln.end[0] == c.line and ln.end <= at]
        if inside is not None:
            inside.notes.append(c.text)
        elif before:
            max(before, key=lambda ln: ln.end).trailing = c.text
        elif (i := bisect_right(starts, at)) < len(lines):
            lines[i].notes.append(c.text)
        else:
            tail.append(c.text)
    return tail


def format_spec(spec: SpecFile) -> str:
    """The canonical text of `spec`, with its comments."""
    lines = _lines(spec)
    tail = _place(spec.comments, lines)
    out: list[str] = []
    for ln in lines:
        if ln.blank_before:
            out.append("\n")
        out.extend(f"{ln.note_indent}{note}\n" for note in ln.notes)
        out.append(f"{ln.text}  {ln.trailing}\n" if ln.trailing else f"{ln.text}\n")
    out.extend(f"{note}\n" for note in tail)
    return "".join(out)
