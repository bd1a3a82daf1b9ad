"""The layer block -> the layer program (kiln.model_config.LayerAssign), every problem recorded at its node.

Sites are named innermost argument first, left to right (norm0, attn0, mlp0, ...); an assignment that nothing
reads, an undefined name, an op other than norm / attention / mlp and `+`, and attention arguments that cannot be
served are refused where they are written.
"""

from __future__ import annotations

from kiln.model_config import (
    GATED_ACTS,
    PLAIN_ACTS,
    AttentionCall,
    LayerAssign,
    LayerExpr,
    MlpCall,
    NormCall,
    Var,
)
from kiln.model_config import Add as AddExpr
from kiln.spec.ast import Assign, BinOp, Call, Expr, LayerBlock, Name
from kiln.spec.formatter import format_expr
from kiln.spec.limits import SIZE_LIMITS
from kiln.spec.values import _bool, _enum, _int, _kwargs, _Report, _suggest

ACTS = GATED_ACTS + PLAIN_ACTS
LAYER_OPS = {"norm": (), "attention": ("causal", "window", "bias", "qkv_bias", "out_bias", "rope", "qk_norm"),
             "mlp": ("act", "bias")}
QK_NORMS = ("rms",)  # attention(qk_norm = rms): a per-head RMSNorm of q and k before rope (Qwen3)
_SITE_PREFIX = {"norm": "norm", "attention": "attn", "mlp": "mlp"}


class LayerResolver:
    """Resolves the layer body to the layer program, naming sites innermost argument first, left to right."""

    def __init__(self, r: _Report, positions: str = "rope"):
        self.r, self.defined, self.counts, self.uses_mlp = r, {"x"}, {"norm": 0, "attn": 0, "mlp": 0}, False
        self.positions = positions
        self.unread: dict[str, Assign] = {}  # name -> its latest assignment, while nothing has read it

    def body(self, block: LayerBlock) -> tuple[LayerAssign, ...]:
        out = []
        x_lines = [i for i, stmt in enumerate(block.body) if stmt.target == "x"]
        for i, stmt in enumerate(block.body):
            value = self.expr(stmt.value)
            # An assignment nobody reads builds ops whose weights become required checkpoint tensors for nothing
            # (and dead graph nodes): refuse it where it is written.
            dead = self.unread.pop(stmt.target, None)
            if dead is not None:
                self._unused(dead)
            if x_lines and i < x_lines[-1]:  # later names (or all, with no `x`) are refused below, as not reaching `x`
                self.unread[stmt.target] = stmt
            self.defined.add(stmt.target)
            if value is not None:
                out.append(LayerAssign(stmt.target, value))
        for stmt in self.unread.values():
            if stmt.target != "x":
                self._unused(stmt)
        if not x_lines:
            self.r.error(block, "the layer block never assigns `x`",
                         "`x` is the layer's input and output: end with e.g. `x = x + mlp(norm(x), act = swiglu)`")
        elif x_lines[-1] + 1 < len(block.body):
            stmt = block.body[x_lines[-1] + 1]
            self.r.error(stmt, f"`{stmt.target}` is assigned after the last assignment to `x` and never reaches "
                         "the layer's output", "end the layer block with an assignment to `x`")
        return tuple(out)

    def _unused(self, stmt: Assign) -> None:
        self.r.error(stmt, f"`{stmt.target}` is assigned but never used",
                     f"use `{stmt.target}` in a later line, or remove the assignment (its weights would be loaded "
                     "for nothing)")

    def expr(self, e: Expr) -> LayerExpr | None:
        if isinstance(e, Name):
            if e.id in self.defined:
                self.unread.pop(e.id, None)
                return Var(e.id)
            self.r.error(e, f"undefined name `{e.id}` in the layer block{_suggest(e.id, self.defined)}",
                         "a name must be assigned before it is used; `x` is the layer's input")
            return None
        if isinstance(e, BinOp):
            left, right = self.expr(e.left), self.expr(e.right)
            if e.op != "+":
                self.r.error(e, f"operator `{e.op}` is not supported in the layer block",
                             "values combine with `+` only (residual adds)")
                return None
            return AddExpr(left, right) if left is not None and right is not None else None
        if isinstance(e, Call):
            return self.call(e)
        self.r.error(e, f"{format_expr(e)} cannot be a value in the layer block",
                     "layer values are names, norm(...), attention(...), mlp(...) and `+`")
        return None

    def call(self, c: Call) -> LayerExpr | None:
        args = [self.expr(a) for a in c.args]  # resolved first: inner calls get the lower site numbers
        if c.func not in LAYER_OPS:
            self.r.error(c, f"unknown layer op `{c.func}`{_suggest(c.func, LAYER_OPS)}",
                         "the layer block calls norm(), attention() and mlp()")
            return None
        if len(c.args) != 1:
            self.r.error(c, f"{c.func}() takes exactly one positional argument (its input), got {len(c.args)}",
                         f"e.g. {c.func}(x)")
        kw = _kwargs(self.r, c, LAYER_OPS[c.func], ("act",) if c.func == "mlp" else ())
        prefix = _SITE_PREFIX[c.func]
        site = f"{prefix}{self.counts[prefix]}"
        self.counts[prefix] += 1
        vals = {k: _int(self.r, v, k, *SIZE_LIMITS[k]) if k == "window"
                else _qk_norm(self.r, v) if k == "qk_norm" else _bool(self.r, v, k)
                for k, v in kw.items() if k != "act"}
        if vals.get("causal") is False:  # the torch.compile backend builds non-causal kiln::attention itself
            self.r.error(kw["causal"], "attention(causal = false) cannot be served: kiln generates left to right "
                         "over a KV cache, and a cached token cannot attend to tokens that come after it",
                         "drop `causal = false` (attention is causal by default)")
            vals["causal"] = None
        if vals.get("rope") is True and self.positions != "rope":
            self.r.error(kw["rope"], "attention(rope = true) but the model has no rotary embedding "
                         f"(positions = {self.positions})",
                         "add e.g. `rope = rope(theta = 10000)` to the model block, or drop `rope = true`")
            vals["rope"] = None
        if c.func == "mlp":
            self.uses_mlp = True
            vals["act"] = _enum(self.r, kw["act"], "act", "activation", ACTS) if "act" in kw else None
        if len(args) != 1 or args[0] is None or None in vals.values():
            return None
        if c.func == "norm":
            return NormCall(args[0], site)
        if c.func == "mlp":
            return MlpCall(args[0], site, vals["act"], vals.get("bias", False))
        bias = vals.get("bias", False)
        return AttentionCall(args[0], site, vals.get("causal", True), vals.get("window"),
                             vals.get("qkv_bias", bias), vals.get("out_bias", bias), vals.get("rope", True),
                             vals.get("qk_norm"))


def _qk_norm(r: _Report, e: Expr) -> str | None:
    """attention(qk_norm = rms): the kind alone; its eps is the model norm's, as in Qwen3's checkpoints."""
    hint = ("`qk_norm = rms` normalizes each head of q and k before rope (weights [head_dim], the model norm's "
            "eps); leave it out for no q/k norm")
    if isinstance(e, Call) and e.func in QK_NORMS:
        r.error(e, f"qk_norm = {e.func} takes no arguments: the q/k norm uses the eps of the model's `norm`", hint)
        return None
    if isinstance(e, Name) and e.id in QK_NORMS:
        return e.id
    if isinstance(e, Name):
        r.error(e, f"unknown qk_norm `{e.id}`{_suggest(e.id, QK_NORMS)}", hint)
    else:
        r.error(e, f"qk_norm must be {' or '.join(QK_NORMS)}, got {format_expr(e)}", hint)
    return None


def walk_layer(body: tuple[LayerAssign, ...]):
    """Every call in the layer program, outermost first."""
    stack: list[LayerExpr] = [a.value for a in body]
    while stack:
        e = stack.pop()
        yield e
        if isinstance(e, AddExpr):
            stack += [e.left, e.right]
        elif not isinstance(e, Var):
            stack.append(e.arg)

