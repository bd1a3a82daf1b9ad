"""Every kernel kiln launches at real model sizes, compiled for sm90 (H100) and sm80 (A100) on this machine.

The launches come from the wrappers themselves (tests.support.launch_capture): every KERNEL_TABLE op at its real
size in bf16 and fp16, the quantized linears at Llama-3.2-1B / 3.1-8B and SmolLM2 shapes at batch 1 to 64 in each
weight format, and a paged step (K/V write, split-KV decode and its merge, prefill) with a 16-bit and an int8
cache. Each distinct launch (template, constexprs, options, argument types) is built by triton's own ptxas in a
subprocess, so a kernel that does not compile for a GPU, or needs more shared memory than it has, fails here
rather than in a GPU session. flash_attn's launches are left to test_cuda_compile.py, which builds every
candidate tile the autotuner may pick.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from kiln.codegen import paged, paged_tiles
from kiln.codegen.tiles import shared_memory_limit
from kiln.compile.lowering import KERNEL_TABLE
from tests.support.cuda_compile import compile_in_subprocess, ptxas_available
from tests.support.kernel_examples import kernel_examples
from tests.support.launch_capture import gpu_launches, to_meta

pytestmark = pytest.mark.skipif(not ptxas_available(), reason="triton's CUDA backend (ptxas) is not installed")

TEMPLATES = Path(__file__).resolve().parents[2] / "codegen" / "templates"
META = {"device": "meta"}
_NO_KERNEL = {torch.ops.kiln.mod_narrow.default}  # views of the first rows, sized by a count read on the host
# (N, K) of the projections (q|k|v fused, o, gate|up fused, down) of Llama-3.2-1B, Llama-3.1-8B and SmolLM2-135M
LINEAR_SHAPES = [(3072, 2048), (2048, 2048), (16384, 2048), (2048, 8192),
                 (6144, 4096), (4096, 4096), (28672, 4096), (4096, 14336),
                 (960, 576), (576, 576), (3072, 576), (576, 1536)]  # fmt: skip


def _group(fmt: str) -> int:
    return 32 if "g32" in fmt else 128 if "g128" in fmt else 1


def _quantized_args(fmt: str, n: int, k: int) -> tuple:
    """kiln::linear_w8 / linear_w4's weight arguments after x, in each stored format."""
    if fmt == "int8":  # per output channel
        return torch.empty(n, k, dtype=torch.int8, **META), torch.empty(n, **META)
    if fmt == "int8-g32":  # GGUF Q8_0: a scale per 32 along K
        return torch.empty(n, k, dtype=torch.int8, **META), torch.empty(n, k // 32, **META)
    group = _group(fmt)
    w, s = torch.empty(n, k // 2, dtype=torch.uint8, **META), torch.empty(n, k // group, **META)
    zeros = {"int4-g128": None, "int4-g32": None, "int4-g128-asym": torch.empty(n, k // group, dtype=torch.uint8,
                                                                                **META),
             "int4-g32-min": torch.empty(n, k // group, **META)}[fmt]  # GGUF Q4_0 is int4-g32, Q4_1 -g32-min
    return w, s, zeros, group


def _linears() -> None:
    for fmt in ("int8", "int8-g32", "int4-g128", "int4-g128-asym", "int4-g32", "int4-g32-min"):
        op = KERNEL_TABLE[torch.ops.kiln.linear_w8.default if fmt.startswith("int8") else
                          torch.ops.kiln.linear_w4.default]  # fmt: skip
        for n, k in (s for s in LINEAR_SHAPES if s[1] % _group(fmt) == 0):
            for m in (1, 7, 16, 64):
                weights = _quantized_args(fmt, n, k)
                bias = torch.empty(n, dtype=torch.bfloat16, **META) if n == 960 else None  # SmolLM2 has none: any
                op(torch.empty(m, k, dtype=torch.bfloat16, **META), *weights, bias)


def _paged_step(kv_dtype: torch.dtype, decode: bool) -> None:
    """One layer of a step of 8 sequences over Llama-3.2-1B's attention (32 / 8 heads of 64), blocks of 16."""
    heads, kv_heads, d, bs, seqs = 32, 8, 64, 16, 8
    q_len = 1 if decode else 97
    n = seqs * q_len
    i32 = dict(dtype=torch.int32, **META)
    cache = torch.empty(2, 2, 512, bs, kv_heads, d, dtype=kv_dtype, **META)
    scales = torch.empty(2, 2, 512, bs, kv_heads, **META) if kv_dtype == torch.int8 else None
    paged.paged_attention(
        torch.empty(1, n, heads * d, dtype=torch.bfloat16, **META),
        torch.empty(1, n, kv_heads * d, dtype=torch.bfloat16, **META),
        torch.empty(1, n, kv_heads * d, dtype=torch.bfloat16, **META), cache, 1, torch.empty(n, dtype=torch.int64,
                                                                                             **META),
        torch.empty(seqs, 64, **i32), torch.empty(seqs, **i32), torch.empty(seqs + 1, **i32), q_len, 1000, heads,
        kv_heads, True, 0, d**-0.5, scales, num_splits=4 if decode else None,
    )  # fmt: skip


def _launches(monkeypatch: pytest.MonkeyPatch, arch: int) -> list[dict]:
    with gpu_launches(monkeypatch, arch) as requests:
        for dtype in (torch.bfloat16, torch.float16):
            for op, build in kernel_examples("real", dtype, "cpu").items():
                if build is not None and op not in _NO_KERNEL:
                    KERNEL_TABLE[op](*to_meta(build()))
        _linears()
        for kv_dtype in (torch.bfloat16, torch.int8):
            for decode in (True, False):
                _paged_step(kv_dtype, decode)
    return [r for r in requests if r["template"] != "flash_attn"]


def _distinct(requests: list[dict], ignore: tuple[str, ...]) -> list[dict]:
    """The first request of each kernel variant, telling apart neither the constexprs in `ignore` nor a split
    count past 2 (a constexpr that only scales offsets), nor which integer arguments happened to divide by 16."""
    seen, kept = set(), []
    for r in requests:
        consts = {k: min(v, 2) if k == "SPLIT_K" else v for k, v in r["consts"].items() if k not in ignore}
        key = str((r["template"], r["op"], sorted(consts.items()), sorted(r["options"].items()), r["dtypes"]))
        if key not in seen:
            seen.add(key)
            kept.append(r)
    return kept


def _compile(requests: list[dict], arch: int) -> None:
    results = compile_in_subprocess(requests)  # asserts that each compiled
    limit = shared_memory_limit(divmod(arch, 10))
    for req, res in zip(requests, results, strict=True):  # triton refuses such a kernel only when it loads
        assert res["shared"] <= limit, f"{req['template']} {req['consts']}: {res['shared']} B of shared memory"


def test_every_launched_kernel_compiles_for_h100(monkeypatch):
    captured = _launches(monkeypatch, 90)
    launched = {r["template"] for r in captured} | {"flash_attn"}
    templates = {p.name.removesuffix(".py.j2") for p in TEMPLATES.glob("*.py.j2") if not p.name.startswith("_")}
    assert templates <= launched, f"templates no launch here reaches: {sorted(templates - launched)}"
    quant = [r for r in captured if r["template"] in ("quant_gemv", "quant_gemm")]
    # the quantized linears as an H100 gets them: both kernels, split-K with its reduce pass, every weight format
    assert {r["template"] for r in quant} == {"quant_gemv", "quant_gemm"} and "quant_reduce" in launched
    assert any(r["consts"]["SPLIT_K"] > 1 for r in quant) and any(r["consts"]["SPLIT_K"] == 1 for r in quant)
    assert {(r["consts"]["BITS"], r["consts"]["HAS_ZEROS"], r["consts"]["ZERO_IS_MIN"], r["consts"]["GROUP_SCALES8"])
            for r in quant} == {(8, False, False, False), (8, False, False, True), (4, False, False, False),
                                (4, True, False, False), (4, True, True, False)}  # fmt: skip
    # 16-bit dots as the GPU runs them, not the interpreter's fp32 workaround
    assert all(r["consts"]["DOT_FP32"] is False for r in captured if "DOT_FP32" in r["consts"]
               and "*fp32" not in (r["dtypes"].get("x_ptr"), r["dtypes"].get("q_ptr")))  # fmt: skip
    _compile(_distinct(captured, ignore=()), 90)


def test_each_kernel_variant_compiles_for_a100(monkeypatch):
    # A100s are not what kiln is measured on: one request per variant that changes the kernel's code
    _compile(_distinct(_launches(monkeypatch, 80), ignore=("GROUP", "EVEN_K", "HAS_BIAS", "SPLIT_K")), 80)


def test_the_pretend_gpu_leaves_no_tile_behind():
    meta = torch.device("meta")
    tiles = lambda: (paged_tiles.prefill_tile(meta, torch.bfloat16, 64, True, False),  # noqa: E731
                     paged_tiles.decode_tile(meta, torch.bfloat16, torch.bfloat16, 64, 4))
    before = tiles()
    with pytest.MonkeyPatch.context() as mp, gpu_launches(mp, 90):
        inside = tiles()
    assert inside[0] != before[0] and inside[1] != before[1]  # an H100's tiles, not the interpreter's
    assert tiles() == before
