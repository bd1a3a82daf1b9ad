"""The typed AST of a .kiln spec file.

The parser builds it, the formatter prints it, validation resolves it into a ModelConfig. Every node keeps
its source position in `span`, which takes no part in equality: parse(format(ast)) == ast compares
structure and values only. Comments are kept beside the tree (SpecFile.comments), also outside equality.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class Span:
    """1-based start and end position of a node in its source file."""

    line: int = 0
    column: int = 0
    end_line: int = 0
    end_column: int = 0


def _span() -> Span:
    return field(default_factory=Span, compare=False, repr=False)


# ---- expressions -----------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Num:
    value: int | float
    span: Span = _span()


@dataclass(frozen=True)
class Bool:
    value: bool
    span: Span = _span()


@dataclass(frozen=True)
class Str:
    value: str
    span: Span = _span()


@dataclass(frozen=True)
class Name:
    """A bare identifier: a variable in a layer body (`x`), or an enum-like value (`swiglu`, `bf16`)."""

    id: str
    span: Span = _span()


@dataclass(frozen=True)
class Keyword:
    name: str
    value: Expr
    span: Span = _span()


@dataclass(frozen=True)
class Call:
    """`func(arg, ..., key = value, ...)`: an op in a layer body, or a structured value (`rms(eps = 1e-5)`)."""

    func: str
    args: tuple[Expr, ...] = ()
    kwargs: tuple[Keyword, ...] = ()
    span: Span = _span()


@dataclass(frozen=True)
class BinOp:
    """`left op right`; op is "+" (residual add) or "*"."""

    op: str
    left: Expr
    right: Expr
    span: Span = _span()


Expr = Num | Bool | Str | Name | Call | BinOp


# ---- statements and blocks -------------------------------------------------------------------------------


@dataclass(frozen=True)
class Setting:
    """`key = value` directly inside a model or compile block."""

    key: str
    value: Expr
    span: Span = _span()


@dataclass(frozen=True)
class Assign:
    """`target = expr` inside a layer block."""

    target: str
    value: Expr
    span: Span = _span()


@dataclass(frozen=True)
class LayerBlock:
    """`layer { ... }`: the body repeated `layers` times; `x` flows in and out."""

    body: tuple[Assign, ...]
    span: Span = _span()


@dataclass(frozen=True)
class ModelBlock:
    """`model "name" { ... }`: settings and the layer block, in source order."""

    name: str
    items: tuple[Setting | LayerBlock, ...]
    span: Span = _span()


@dataclass(frozen=True)
class CompileBlock:
    """`compile { ... }`: how to compile (dtype, passes and their options)."""

    settings: tuple[Setting, ...]
    span: Span = _span()


@dataclass(frozen=True)
class Comment:
    """A `# ...` comment: where it starts (1-based) and its text, `#` included."""

    line: int
    column: int
    text: str


@dataclass(frozen=True)
class SpecFile:
    model: ModelBlock
    compile: CompileBlock | None = None
    path: str = field(default="<spec>", compare=False)
    source: str = field(default="", compare=False, repr=False)
    # Comments in source order; the formatter puts them back next to their constructs by position.
    comments: tuple[Comment, ...] = field(default=(), compare=False, repr=False)
