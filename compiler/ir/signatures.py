"""The attention ops' signatures (and the fused q/k norm + rope's), written once: each parameter's name, position
and schema type.

The op registrations (kiln.ir.ops, ops_level2, ops_paged) take their torch schema from here, and every Python
function that has one of these signatures (the references, lowering's kernel calls, codegen's wrappers)
is checked against it when it is defined (`implements`), so a renamed, reordered or missing parameter fails
at import instead of binding a value to the wrong name. Code that reads an attention node's arguments can
name them (`ATTENTION.bind(node.args)`) instead of counting positions.

Pieces: QKV (the projections), ATTENTION_PARAMS (the semantics every attention shares: head counts, causal,
window, scale), TILE (flash_tiling's tile config), and the paged op's step inputs and cache.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

from kiln.errors import InternalError

F = TypeVar("F", bound=Callable[..., Any])


@dataclass(frozen=True)
class Param:
    """One parameter: its name, its torch schema type (`Tensor`, `Tensor?`, `SymInt`, `bool`, `float`) and whether
    the op writes it (a mutated tensor: custom_op's mutates_args)."""

    name: str
    kind: str
    mutated: bool = False


@dataclass(frozen=True)
class OpSignature:
    """An op's parameters in order and its return type, as a torch schema and as Python parameter names."""

    op: str  # "kiln::attention"
    params: tuple[Param, ...]
    returns: str = "Tensor"

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(p.name for p in self.params)

    @property
    def mutated(self) -> tuple[str, ...]:
        return tuple(p.name for p in self.params if p.mutated)

    def schema(self) -> str:
        """The torch schema string custom_op registers, e.g. "(Tensor q, ..., float scale) -> Tensor": what
        torch.library.infer_schema makes of the same Python signature (ints are SymInt, a mutated tensor at
        position i is Tensor(ai!))."""
        def arg(i: int, p: Param) -> str:
            kind = p.kind.replace("Tensor", f"Tensor(a{i}!)", 1) if p.mutated else p.kind
            return f"{kind} {p.name}"

        return "(" + ", ".join(arg(i, p) for i, p in enumerate(self.params)) + f") -> {self.returns}"

    def bind(self, args: Sequence[Any], kwargs: Mapping[str, Any] | None = None) -> dict[str, Any]:
        """A call's arguments (an fx node's args and kwargs) by parameter name."""
        if len(args) > len(self.params):
            raise InternalError(f"{self.op} takes {len(self.params)} arguments, got {len(args)}")
        bound = dict(zip(self.names[: len(args)], args, strict=True)) | dict(kwargs or {})
        missing = [n for n in self.names if n not in bound]
        if missing:
            raise InternalError(f"{self.op} call without {missing}")
        return bound

    def values(self, mapping: Mapping[str, Any]) -> tuple[Any, ...]:
        """The arguments in this signature's order, taken by name from `mapping` (e.g. a wrapper's locals())."""
        return take(self.params, mapping)

    def implements(self, fn: F | None = None, *, extra: Sequence[str] = ()) -> Any:
        """Decorator: check that fn's positional parameters are this signature's, in order, followed only by
        `extra` ones (e.g. a wrapper's optional tile). Drift is an InternalError at definition time."""

        def check(f: F) -> F:
            check_params(f, self.names, extra=extra, what=self.op)
            return f

        return check if fn is None else check(fn)


def take(params: Sequence[Param], mapping: Mapping[str, Any]) -> tuple[Any, ...]:
    """The values of `params` (a signature or a piece of one), in order, by name from `mapping`."""
    return tuple(mapping[p.name] for p in params)


def check_params(fn: Callable[..., Any], names: Sequence[str], *, extra: Sequence[str] = (), what: str = "") -> None:
    """fn's positional parameters must be `names` in order, then a prefix of `extra` (keyword-only ones are free)."""
    positional = [
        p.name for p in inspect.signature(fn).parameters.values()
        if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)
    ]  # fmt: skip
    head, tail = positional[: len(names)], positional[len(names) :]
    if head != list(names) or tail != list(extra)[: len(tail)]:
        raise InternalError(
            f"{fn.__module__}.{fn.__qualname__} has parameters {positional}; the signature of {what} in "
            f"kiln.ir.signatures is {list(names)}" + (f" then optionally {list(extra)}" if extra else "")
        )


def _params(spec: str) -> tuple[Param, ...]:
    """"Tensor q, SymInt layer" -> Params (the table below reads like a schema)."""
    kinds_names = [item.strip().rsplit(" ", 1) for item in spec.split(",")]
    return tuple(Param(name, kind) for kind, name in kinds_names)


QKV = _params("Tensor q, Tensor k, Tensor v")
ATTENTION_PARAMS = _params("SymInt num_heads, SymInt num_kv_heads, bool causal, SymInt window, float scale")
TILE = _params("SymInt block_m, SymInt block_n, SymInt num_warps, SymInt num_stages")
# The paged op's cache, written in place (kv_scales is None for a float cache and has no default: see
# kiln.ir.ops_paged), and the step inputs it reads: kiln.step.StepBatch's fields of the same names, in its order and
# of its kinds (kiln.ir may not import kiln.step; tests/passes/test_kv_cache_inputs.py holds them together).
PAGED_CACHE = (Param("kv_cache", "Tensor", mutated=True), Param("layer", "SymInt"))
PAGED_STEP = _params("Tensor slot_mapping, Tensor block_tables, Tensor context_lens, Tensor query_start_loc, "
                     "SymInt max_query_len, SymInt max_context_len")
PAGED_SCALES = (Param("kv_scales", "Tensor?", mutated=True),)

ATTENTION = OpSignature("kiln::attention", QKV + ATTENTION_PARAMS)
FLASH_ATTENTION = OpSignature("kiln::flash_attention", QKV + ATTENTION_PARAMS + TILE)
PAGED_ATTENTION = OpSignature("kiln::paged_attention", QKV + PAGED_CACHE + PAGED_STEP + ATTENTION_PARAMS + PAGED_SCALES)

# kiln::qk_norm_rope (ops_level2, made by rope_fusion): head_rms_norm's arguments for q and k over the q|k slab, the
# column where k starts, then rope's.
QK_NORM_ROPE = OpSignature(
    "kiln::qk_norm_rope",
    _params(
        "Tensor qk, Tensor q_weight, Tensor k_weight, SymInt q_features, float eps, Tensor positions, Tensor inv_freq"
    ),
)
