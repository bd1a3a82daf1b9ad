"""Host wrappers for the act family (templates/act.py.j2): gated activations (SwiGLU / GeGLU) and plain ones."""

from __future__ import annotations

import torch

from kiln.codegen._host import cdiv, check_out, check_same_device, check_tensor, launch
from kiln.errors import CodegenError

ACT_KINDS = ("silu", "gelu", "gelu_tanh", "relu")
_BLOCK = 1024


def _check_kind(kind: str) -> None:
    if kind not in ACT_KINDS:
        raise CodegenError(f"unknown activation {kind!r}; expected one of {ACT_KINDS}")


def _contiguous(t: torch.Tensor, name: str) -> None:
    if not t.is_contiguous():
        raise CodegenError(f"{name} must be contiguous (strides {t.stride()}); call .contiguous()")


def _launch(op: str, kind: str, gate: torch.Tensor, up: torch.Tensor | None, out: torch.Tensor) -> torch.Tensor:
    n = gate.numel()
    consts = {"ACT": kind, "GATED": up is not None, "BLOCK_SIZE": _BLOCK}
    if n > 0:
        args = dict(gate_ptr=gate, up_ptr=up if up is not None else gate, out_ptr=out, n_elements=n)
        launch("act", op, (cdiv(n, _BLOCK),), args, consts, {"num_warps": 4})
    return out


def gated_act(gate: torch.Tensor, up: torch.Tensor, kind: str, *, out: torch.Tensor | None = None) -> torch.Tensor:
    """kiln::gated_act: act(gate) * up for kind in silu (SwiGLU), gelu, gelu_tanh (GeGLU), relu."""
    _check_kind(kind)
    check_tensor(gate, "gate")
    check_tensor(up, "up", dtypes=(gate.dtype,))
    if up.shape != gate.shape:
        raise CodegenError(f"up shape {tuple(up.shape)} differs from gate shape {tuple(gate.shape)}")
    _contiguous(gate, "gate")
    _contiguous(up, "up")
    check_same_device(gate=gate, up=up)
    return _launch("gated_act", kind, gate, up, check_out(out, gate))


def act(x: torch.Tensor, kind: str, *, out: torch.Tensor | None = None) -> torch.Tensor:
    """kiln::act: elementwise activation, kind in silu, gelu, gelu_tanh, relu."""
    _check_kind(kind)
    check_tensor(x, "x")
    _contiguous(x, "x")
    return _launch("act", kind, x, None, check_out(out, x))
