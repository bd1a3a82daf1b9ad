"""Shared host-side helpers for the kernel wrappers: input checks and the load-and-launch step."""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from threading import local
from typing import Any

import torch

from kiln import env
from kiln.codegen.cache import load_kernel
from kiln.errors import CodegenError, InternalError

FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


class _LaunchState(local):
    """Per thread: a compile recording its kernels in one thread must not turn another thread's launches into
    dry runs (an engine serving while a drafter or a Dynamo graph compiles)."""

    # While set (see `recording`), launches report their kernel request here instead of loading and running it.
    recorder: Callable[..., None] | None = None
    # While a lowered graph node's wrapper runs, its BoundKernels (see below).
    site: BoundKernels | None = None


_state = _LaunchState()


class BoundKernels:
    """A lowered graph node's kernel call, bound once at lowering (kiln.compile.lowering.lower).

    Each kernel instance the node launches is loaded on its first launch and kept here, so later launches go
    straight to the jitted function: no kernel-cache lookup, no environment read and (unless KILN_DEBUG was set
    when the graph was lowered) no tensor checks, which the graph's fake propagation already did.
    """

    def __init__(self, fn: Callable[..., Any], *, checked: bool):
        self.fn, self.checked = fn, checked
        self.kernels: dict[tuple, Any] = {}
        self.__name__, self.__qualname__, self.__module__ = fn.__name__, fn.__qualname__, fn.__module__

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        state = _state
        prev, state.site = state.site, self
        try:
            return self.fn(*args, **kwargs)
        finally:
            state.site = prev

    def __repr__(self) -> str:
        return f"<bound {self.__name__}: {len(self.kernels)} kernel(s)>"


def _trusted() -> bool:
    site = _state.site
    return site is not None and not site.checked


@contextmanager
def recording(record: Callable[..., None]) -> Iterator[None]:
    """Dry run: inside, every launch calls record(template, name, args, **params) and launches nothing, and
    tensors on any device (meta, fake) pass the device check. params are the kernel request (what load_kernel
    takes), args the launch's runtime arguments by name. Lowering uses it to list a graph's kernels; the tests
    use the arguments' types to compile each launched kernel for a GPU target."""
    prev, _state.recorder = _state.recorder, record
    try:
        yield
    finally:
        _state.recorder = prev


def dot_consts(dtype: torch.dtype) -> dict[str, Any]:
    """The constexprs of a kernel's tl.dot: fp32 inputs take exact products ("ieee"; tf32 would be ~1e-3 off the
    reference), 16-bit inputs the backend default. DOT_FP32: cast the operands to fp32 first, in Triton's CPU
    interpreter, which computes a 16-bit tl.dot wrongly (bf16 products off by orders of magnitude)."""
    dot_fp32 = dtype == torch.float32 or env.triton_interpret()
    return {"INPUT_PRECISION": "ieee" if dot_fp32 else None, "DOT_FP32": dot_fp32}


def next_power_of_2(n: int) -> int:
    return 1 << max(n - 1, 0).bit_length()


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def check_tensor(
    t: Any,
    name: str,
    *,
    ndim: int | None = None,
    dtypes: Sequence[torch.dtype] = FLOAT_DTYPES,
    unit_last_stride: bool = True,
) -> torch.Tensor:
    """Raise CodegenError naming `name` unless t is a tensor of the right rank and dtype on a usable device."""
    if _trusted():
        return t
    return _check_tensor_full(t, name, ndim, dtypes, unit_last_stride)


def _check_tensor_full(
    t: Any, name: str, ndim: int | None, dtypes: Sequence[torch.dtype], unit_last_stride: bool
) -> torch.Tensor:
    if not isinstance(t, torch.Tensor):
        raise CodegenError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if ndim is not None and t.dim() != ndim:
        raise CodegenError(f"{name} must have {ndim} dims, got shape {tuple(t.shape)}")
    if t.dtype not in dtypes:
        raise CodegenError(f"{name} has dtype {t.dtype}; expected one of {[str(d) for d in dtypes]}")
    if t.device.type != "cuda" and not env.triton_interpret() and _state.recorder is None:
        raise CodegenError(
            f"{name} is on {t.device}; Triton kernels need CUDA tensors, or TRITON_INTERPRET=1 set before "
            "triton is imported to run them on CPU"
        )
    if unit_last_stride and t.dim() > 0 and t.shape[-1] > 1 and t.stride(-1) != 1:
        raise CodegenError(f"{name} must have a contiguous last dim (stride {t.stride()}); call .contiguous()")
    return t


def check_same_device(**tensors: torch.Tensor | None) -> None:
    if _trusted():
        return
    named = {k: v for k, v in tensors.items() if v is not None}
    devices = {str(v.device) for v in named.values()}
    if len(devices) > 1:
        where = ", ".join(f"{k} on {v.device}" for k, v in named.items())
        raise CodegenError(f"kernel inputs must share one device: {where}")


def check_out(out: torch.Tensor | None, like: torch.Tensor, name: str = "out") -> torch.Tensor:
    """A contiguous output with like's shape, dtype and device: the given one (checked) or a new one."""
    if out is None:
        return torch.empty(like.shape, dtype=like.dtype, device=like.device)
    if _trusted():
        return out
    check_tensor(out, name, dtypes=(like.dtype,))
    if out.shape != like.shape or out.device != like.device or not out.is_contiguous():
        raise CodegenError(
            f"{name} must be a contiguous {like.dtype} tensor of shape {tuple(like.shape)} on {like.device}, "
            f"got {out.dtype} {tuple(out.shape)} on {out.device} (contiguous={out.is_contiguous()})"
        )
    return out


def rows_view(t: torch.Tensor, name: str) -> torch.Tensor:
    """t as [rows, features] without copying (a kernel writes through views, so copies are refused)."""
    try:
        return t.view(-1, t.shape[-1])
    except RuntimeError:
        raise CodegenError(
            f"{name} with shape {tuple(t.shape)} and strides {t.stride()} cannot be viewed as rows; call .contiguous()"
        ) from None


def launch(
    template: str,
    op: str,
    grid: tuple[int, ...],
    args: Mapping[str, Any],
    consts: dict[str, Any],
    options: dict[str, int],
) -> None:
    """Load the kernel `template`_kernel for these constexprs and launch it on `grid` (bound: see BoundKernels).

    args are the kernel's runtime arguments by parameter name, consts its tl.constexpr ones: everything goes to
    the kernel by keyword, so a misordered stride cannot bind to the wrong parameter. BLOCK_* consts count as the
    tile in the header, the others as params. options are launch options (num_warps, num_stages).
    """
    state = _state
    if state.recorder is not None:
        state.recorder(template, f"{template}_kernel", args, op=op, **_request(consts, options))
        return
    site = state.site
    if site is None:  # a direct call of a wrapper (not from a lowered graph): through the kernel cache
        kernel = load_kernel(template, f"{template}_kernel", op=op, **_request(consts, options))
        check_kernel_args(kernel, template, args, consts)
    else:  # bound: the node's own table, keyed by this instance's constexprs
        key = (template, *consts.values(), *options.values())
        kernel = site.kernels.get(key)
        if kernel is None:
            kernel = load_kernel(template, f"{template}_kernel", op=op, **_request(consts, options))
            check_kernel_args(kernel, template, args, consts)
            site.kernels[key] = kernel
    kernel[grid](**args, **consts, **options)


def check_kernel_args(kernel: Any, template: str, args: Mapping[str, Any], consts: Mapping[str, Any]) -> None:
    """The launch names every parameter of the kernel exactly once, by keyword (Triton's interpreter drops an
    unknown keyword silently, so a misspelt name must be caught here). A mismatch is a bug in the wrapper."""
    if not isinstance(args, Mapping):
        raise InternalError(f"{template}: kernel arguments must be passed by name (a dict), got {type(args).__name__}")
    params = list(kernel.arg_names)
    given = [*args, *consts]
    if sorted(given) != sorted(params):
        missing = [p for p in params if p not in given]
        unknown = [g for g in given if g not in params]
        raise InternalError(f"{template}_kernel launched with missing {missing} and unknown {unknown} arguments")


def _request(consts: dict[str, Any], options: dict[str, int]) -> dict[str, dict[str, Any]]:
    tile = {k: v for k, v in consts.items() if k.startswith("BLOCK_")} | options
    return {"tile": tile, "params": {k: v for k, v in consts.items() if not k.startswith("BLOCK_")}}
