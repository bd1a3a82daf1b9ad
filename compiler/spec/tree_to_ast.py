"""lark's parse tree -> the typed SpecFile AST nodes (kiln.spec.ast), every node with its source span.

Well-formed tokens in a bad order (a positional argument after keywords), numbers too long or beyond the float
range and bad string escapes are found here, while the tree is built: each raises CallError, which the parser
turns into a SpecError pointing at it.
"""

from __future__ import annotations

import json
import math

from lark import Token, Transformer, v_args

from kiln.spec.ast import (
    Assign,
    BinOp,
    Bool,
    Call,
    CompileBlock,
    Expr,
    Keyword,
    LayerBlock,
    ModelBlock,
    Name,
    Num,
    Setting,
    Span,
    Str,
)


class CallError(Exception):
    """A call's arguments are well-formed tokens in a bad order; raised inside the transformer."""

    def __init__(self, span: Span, message: str, hint: str):
        super().__init__(message)
        self.span, self.message, self.hint = span, message, hint


def _span(meta) -> Span:
    return Span(meta.line, meta.column, meta.end_line, meta.end_column)


def _tok_span(tok: Token) -> Span:
    return Span(tok.line, tok.column, tok.end_line, tok.end_column)


def _number(text: str) -> int | float:
    return int(text) if text.replace("_", "").isdigit() else float(text)


def _checked_number(tok: Token, meta) -> int | float:
    try:
        value = _number(str(tok))
    except ValueError:  # an integer longer than Python's int-from-string limit (4300 digits)
        raise CallError(_span(meta), f"number with {len(tok)} digits is too long",
                         "no spec value needs more than a few digits; check for a pasted run of digits") from None
    # 1e999 reads as inf, which no setting accepts and the formatter cannot write back.
    if isinstance(value, float) and not math.isfinite(value):
        raise CallError(_span(meta), f"number {tok} is beyond the floating-point range (it reads as infinity)",
                         "numbers must be finite: write a value below 1.7e308, e.g. eps = 1e-5")
    return value


@v_args(meta=True)
class ToAst(Transformer):
    def start(self, meta, children):
        return children[0], (children[1] if len(children) > 1 else None)

    def value(self, meta, children):
        return children[0]

    def model_block(self, meta, children):
        name = self.string(meta, [children[0]]).value
        return ModelBlock(name, tuple(children[1:]), _span(meta))

    def layer_block(self, meta, children):
        return LayerBlock(tuple(Assign(s.key, s.value, s.span) for s in children), _span(meta))

    def compile_block(self, meta, children):
        return CompileBlock(tuple(children), _span(meta))

    def setting(self, meta, children):
        return Setting(str(children[0]), children[1], _span(meta))

    def kwarg(self, meta, children):
        return Keyword(str(children[0]), children[1], _span(meta))

    def call(self, meta, children):
        args: list[Expr] = []
        kwargs: list[Keyword] = []
        for child in children[1:]:
            if isinstance(child, Keyword):
                kwargs.append(child)
            elif kwargs:
                raise CallError(child.span, f"positional argument after keyword arguments in {children[0]}()",
                                 "put the input first, then `key = value` arguments")
            else:
                args.append(child)
        return Call(str(children[0]), tuple(args), tuple(kwargs), _span(meta))

    def binop(self, meta, children):
        left, op, right = children
        return BinOp(str(op), left, right, _span(meta))

    def int(self, meta, children):
        return Num(_checked_number(children[0], meta), _span(meta))

    float = int

    def neg_int(self, meta, children):
        return Num(-_checked_number(children[1], meta), _span(meta))

    neg_float = neg_int

    def string(self, meta, children):
        tok = children[0]
        try:
            value = json.loads(str(tok), strict=False)
        except json.JSONDecodeError as e:
            raise CallError(_tok_span(tok), f"bad escape in string {tok}",
                             "strings use JSON escapes: \\\" \\\\ \\n \\t \\uXXXX") from e
        return Str(value, _tok_span(tok))

    def true(self, meta, children):
        return Bool(True, _span(meta))

    def false(self, meta, children):
        return Bool(False, _span(meta))

    def name(self, meta, children):
        return Name(str(children[0]), _span(meta))
