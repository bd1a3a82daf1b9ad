"""The kernel launches a codegen wrapper makes, captured as compile requests for a GPU target (see cuda_compile).

`gpu_launches` runs wrappers in codegen's dry-run `recording` mode on meta tensors while the wrappers see an H100
(or any capability / SM count given): the tile choosers, dot constants and splits are those of a real launch on that
GPU, and nothing runs. Each launch becomes a request whose argument types come from the launch itself (a pointer
gets its tensor's dtype, an integer i32 or i64, marked divisible by 16 or equal to 1 as triton specializes it), so
a compile check needs no hand-written signature that could drift from the wrapper.
"""

from __future__ import annotations

import json
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from typing import Any

import pytest
import torch

from kiln import env
from kiln.codegen import _host, paged_tiles, quant

_TRITON_DTYPES = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32", torch.int32: "i32",
                  torch.int64: "i64", torch.int8: "i8", torch.uint8: "u8", torch.bool: "i1"}  # fmt: skip


def to_meta(x: Any) -> Any:
    """Tensors (also inside lists and tuples) as meta tensors of the same shape, strides and dtype."""
    if isinstance(x, torch.Tensor):
        return torch.empty_strided(x.shape, x.stride(), dtype=x.dtype, device="meta")
    if isinstance(x, (list, tuple)):
        return type(x)(to_meta(v) for v in x)
    return x


def _types(args: Mapping[str, Any]) -> dict[str, Any]:
    """The triton signature of a launch's runtime arguments, as triton's launcher specializes them."""
    dtypes, divisible, none, ones = {}, [], [], []
    for name, value in args.items():
        if value is None:
            none.append(name)
        elif isinstance(value, torch.Tensor):
            dtypes[name] = "*" + _TRITON_DTYPES[value.dtype]
        elif isinstance(value, bool):  # as triton's launcher specializes a Python bool
            dtypes[name] = "u1"
        elif isinstance(value, int):
            dtypes[name] = "i32" if -(2**31) <= value < 2**31 else "i64"
            if value == 1:
                ones.append(name)
            elif value % 16 == 0:
                divisible.append(name)
        elif isinstance(value, float):
            dtypes[name] = "fp32"
        else:
            raise TypeError(f"launch argument {name} of type {type(value).__name__}: no triton type for it")
    return {"dtypes": dtypes, "divisible": divisible, "none": none, "ones": ones}


@contextmanager
def gpu_launches(monkeypatch: pytest.MonkeyPatch, arch: int = 90, sm_count: int = 132) -> Iterator[list[dict]]:
    """Inside, wrappers launch nothing and see a CUDA device of compute capability `arch` (90: H100); yields the
    list that collects one compile request per distinct launch (template, constexprs, options, argument types)."""
    capability = divmod(arch, 10)
    seen: set[str] = set()
    requests: list[dict] = []

    def record(template: str, name: str, args: Mapping[str, Any], *, op: str, tile: dict, params: dict) -> None:
        consts = {**params, **{k: v for k, v in tile.items() if k.startswith("BLOCK_")}}
        options = {k: v for k, v in tile.items() if not k.startswith("BLOCK_")}
        req = {"template": template, "name": name, "op": op, "consts": consts, "options": options, "arch": arch,
               **_types(args)}  # fmt: skip
        key = json.dumps(req, sort_keys=True)
        if key not in seen:
            seen.add(key)
            requests.append(req)

    # What a wrapper asks about its device: not the interpreter (dot constants), no autotuning (the default tiles
    # a GPU gets before any tuning; the tuned candidates are compiled by test_cuda_compile), the GPU's capability
    # and SM count for the tile choosers.
    monkeypatch.setattr(env, "triton_interpret", lambda: False)
    monkeypatch.setattr(env, "autotune", lambda: False)
    monkeypatch.setattr(quant, "device_info", lambda device: (sm_count, capability))
    monkeypatch.setattr(paged_tiles, "_capability", lambda device: capability)
    # the tile choosers cache per device: nothing chosen for the pretend GPU may outlive it, or leak into it
    caches = (paged_tiles.decode_tile, paged_tiles.prefill_tile)
    for cached in caches:
        cached.cache_clear()
    try:
        with _host.recording(record):
            yield requests
    finally:
        for cached in caches:
            cached.cache_clear()
