"""What the rule families of kiln.dynamo.rules share: a dim index made non-negative, a node's state when it is one
of the given kinds, a state passed on unchanged, the fp32 source of a value and whether a value is a float tensor."""

from __future__ import annotations

import torch
from torch import fx

from kiln.dynamo.fx_query import tensor
from kiln.dynamo.normalize import Normalizer, St, resolve

_FLOATS = (torch.float32, torch.float16, torch.bfloat16)


def _dim(d: object, ndim: int) -> int | None:
    return d % ndim if isinstance(d, int) and ndim > 0 else None


def _st(nz: Normalizer, n: object, *kinds: str) -> St | None:
    s = nz.st.get(n) if isinstance(n, fx.Node) else None
    return s if s is not None and s.kind in kinds else None


def _pass(nz: Normalizer, node: fx.Node, x: object) -> None:
    if isinstance(x, fx.Node) and tensor(x) is not None:
        nz.st[node] = nz.st.get(x) or St("same", x)


def _f32_of(nz: Normalizer, n: object) -> fx.Node | None:
    """The tensor whose fp32 version n is (n itself when it already is fp32)."""
    s = _st(nz, n, "f32")
    if s is not None:
        return resolve(nz, s.x)
    t = tensor(n)
    return resolve(nz, n) if t is not None and t.dtype == torch.float32 else None


def _float_tensor(n: object) -> bool:
    t = tensor(n)
    return t is not None and t.dtype in _FLOATS
