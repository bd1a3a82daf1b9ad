"""The quantized-linear kernels (quant_gemv / quant_gemm / quant_reduce templates) against dequantize-then-matmul.

Odd shapes (N and K not powers of two), M = 1, 3, 17, 33, every stored form (int8 per channel, int8 with Q8_0's
per-group scales, int4 groups 32 / 64 / 128 symmetric and with zero points, int4 with GGUF's float minimums),
outputs poisoned with NaN before every run; the split-K path (partials + quant_reduce) forced and chosen.
"""

import pytest
import torch

from kiln.codegen.quant_tiles import QuantTile
from kiln.errors import CodegenError
from kiln.quant.formats import QuantizedWeight, QuantScheme, dequantize, pack_int4, quantize_rtn


def _q8_groups(w: torch.Tensor, group: int = 32) -> QuantizedWeight:
    """GGUF's Q8_0 form: int8 codes with a scale per group of 32 along K."""
    n, k = w.shape
    wg = w.reshape(n, k // group, group)
    scales = (wg.abs().amax(-1) / 127).clamp(min=1e-8)
    codes = torch.round(wg / scales[..., None]).clamp(-127, 127).to(torch.int8).reshape(n, k)
    return QuantizedWeight(codes, scales, None, 8, group)


def _q4_mins(w: torch.Tensor, group: int = 32) -> QuantizedWeight:
    """GGUF's Q4_1 form: w = q * s + m with a float minimum per group."""
    n, k = w.shape
    wg = w.reshape(n, k // group, group)
    lo, hi = wg.amin(-1), wg.amax(-1)
    scales = ((hi - lo) / 15).clamp(min=1e-8)
    codes = torch.round((wg - lo[..., None]) / scales[..., None]).clamp(0, 15).reshape(n, k)
    return QuantizedWeight(pack_int4(codes), scales, lo, 4, group)


FORMS = {
    "int8": lambda w: quantize_rtn(w, QuantScheme(bits=8)),
    "int8-g32": _q8_groups,
    "int4-g32": lambda w: quantize_rtn(w, QuantScheme(bits=4, group=32)),
    "int4-g64-asym": lambda w: quantize_rtn(w, QuantScheme(bits=4, group=64, symmetric=False)),
    "int4-g128": lambda w: quantize_rtn(w, QuantScheme(bits=4, group=128)),
    "int4-g32-min": _q4_mins,
}
SHAPE = {"int8": (40, 100), "int8-g32": (72, 160), "int4-g32": (72, 416), "int4-g64-asym": (40, 192),
         "int4-g128": (24, 384), "int4-g32-min": (40, 160)}  # fmt: skip  (N, K): none a power of two


def _case(form: str, m: int, bias: bool, dtype=torch.float32):
    n, k = SHAPE[form]
    g = torch.Generator().manual_seed(m * 1000 + n + k)
    qw = FORMS[form](torch.randn(n, k, generator=g))
    x = torch.randn(m, k, generator=g).to(dtype)
    b = torch.randn(n, generator=g).to(dtype) if bias else None
    want = x.double() @ dequantize(qw).double().T + (b.double() if bias else 0)
    return qw, x, b, want.float()


def _run(qw, x, b, kernel=None, out=None, tile=None):
    from kiln.codegen.quant import linear_w4, linear_w8

    if qw.bits == 8:
        return linear_w8(x, qw.qweight, qw.scales, b, out=out, kernel=kernel, tile=tile)
    return linear_w4(x, qw.qweight, qw.scales, qw.zeros, qw.group, b, out=out, kernel=kernel, tile=tile)


@pytest.mark.parametrize(
    "kernel,m", [("quant_gemv", 1), ("quant_gemv", 3), ("quant_gemv", 17), ("quant_gemm", 1), ("quant_gemm", 33)]
)
@pytest.mark.parametrize("form", sorted(FORMS))
def test_kernel_equals_dequantize_then_matmul(form, kernel, m):
    qw, x, b, want = _case(form, m, bias=(m == 3 or m == 33))
    out = torch.full(want.shape, float("nan"))
    got = _run(qw, x, b, kernel, out=out)
    assert got is out
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("form", ["int4-g32", "int4-g32-min", "int8"])
def test_gemm_at_17_rows_with_a_tile_per_group(form):
    # BLOCK_K = 32: each K-tile inside one group (one scale per column); 17 rows: two M tiles of 16.
    qw, x, b, want = _case(form, 17, bias=True)
    tile = QuantTile("quant_gemm", 16, 16, 32)
    torch.testing.assert_close(_run(qw, x, b, tile=tile), want, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize(
    "form,tile",
    [
        ("int4-g64-asym", QuantTile("quant_gemv", 1, 8, 64, split_k=3)),
        ("int4-g32-min", QuantTile("quant_gemv", 1, 16, 32, split_k=2)),
        ("int8-g32", QuantTile("quant_gemv", 1, 8, 32, split_k=5)),
        ("int8", QuantTile("quant_gemm", 16, 16, 16, split_k=4)),
        ("int4-g128", QuantTile("quant_gemm", 32, 16, 64, split_k=2)),
    ],
    ids=lambda v: v if isinstance(v, str) else f"{v.kernel}-split{v.split_k}",
)
def test_split_k_partials_are_reduced_in_a_fixed_order(form, tile, monkeypatch):
    import kiln.codegen.quant as quant

    launched = []
    real = quant.launch
    monkeypatch.setattr(quant, "launch", lambda template, *a: (launched.append((template, a[1])), real(template, *a)))
    m = 3 if tile.kernel == "quant_gemv" else 17
    qw, x, b, want = _case(form, m, bias=True)
    out = torch.full(want.shape, float("nan"))
    got = _run(qw, x, b, out=out, tile=tile)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    (kernel, grid), (reduce, _) = launched
    assert (kernel, reduce) == (tile.kernel, "quant_reduce")
    assert grid[2] == tile.split_k > 1  # every split has K to cover
    again = _run(qw, x, b, tile=tile)
    assert torch.equal(again, got)  # deterministic: no atomics


def test_wrapper_picks_the_split_k_path_when_tiles_cannot_fill_the_sms(monkeypatch):
    import kiln.codegen.quant as quant

    launched = []
    real = quant.launch
    monkeypatch.setattr(quant, "launch", lambda template, *a: (launched.append(template), real(template, *a)))
    monkeypatch.setattr(quant, "device_info", lambda device: (8, (0, 0)))  # 8 SMs: 2 GEMV tiles cannot fill them
    n, k = 24, 1536
    g = torch.Generator().manual_seed(5)
    qw = quantize_rtn(torch.randn(n, k, generator=g), QuantScheme(bits=4, group=128))
    x = torch.randn(1, k, generator=g)
    got = _run(qw, x, None)
    assert launched == ["quant_gemv", "quant_reduce"]
    torch.testing.assert_close(got, (x.double() @ dequantize(qw).double().T).float(), rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("m", [1, 17])
def test_wrapper_picks_kernel_by_m_and_keeps_leading_dims(m, monkeypatch):
    import kiln.codegen.quant as quant

    launched = []
    real = quant.launch
    monkeypatch.setattr(quant, "launch", lambda template, *a: (launched.append(template), real(template, *a)))
    qw, x, b, want = _case("int4-g32", m, bias=False)
    got = _run(qw, x.view(1, m, -1), b)
    assert launched == ["quant_gemv" if m <= quant.GEMV_MAX_M else "quant_gemm"]
    assert got.shape == (1, m, want.shape[1])
    torch.testing.assert_close(got[0], want, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("kernel", ["quant_gemv", "quant_gemm"])
@pytest.mark.parametrize("form", ["int8", "int4-g32"])
def test_bf16_activations_come_back_bf16(form, kernel):
    qw, x, b, want = _case(form, 5, bias=True, dtype=torch.bfloat16)
    got = _run(qw, x, b, kernel)
    assert got.dtype == torch.bfloat16
    # bf16 inputs and output: one bf16 step of the output (plus the weight's rounding to bf16 in the GEMM).
    torch.testing.assert_close(got.float(), want, rtol=3e-2, atol=5e-2)


def test_bad_inputs_are_codegen_errors():
    from kiln.codegen.quant import linear_w4, linear_w8

    qw = quantize_rtn(torch.randn(40, 96), QuantScheme(bits=4, group=32))
    x = torch.randn(2, 96)
    with pytest.raises(CodegenError, match="K a multiple of the group"):
        linear_w4(x, qw.qweight, qw.scales, None, 64)
    with pytest.raises(CodegenError, match="x has 95 features"):
        linear_w4(torch.randn(2, 95), qw.qweight, qw.scales, None, 32)
    with pytest.raises(CodegenError, match="qweight has dtype"):
        linear_w8(x, qw.qweight, qw.scales.flatten())
    with pytest.raises(CodegenError, match="unknown quantized-linear kernel"):
        linear_w4(x, qw.qweight, qw.scales, None, 32, kernel="cublas")
    with pytest.raises(CodegenError, match="block_k at least 32"):
        linear_w4(x, qw.qweight, qw.scales, None, 32, tile=QuantTile("quant_gemv", 1, 4, 16))
    with pytest.raises(CodegenError, match="at least 16"):
        linear_w4(x, qw.qweight, qw.scales, None, 32, tile=QuantTile("quant_gemm", 16, 8, 32))


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("n,k", [(3072, 2048), (2048, 8192), (576, 1536)], ids=["qkv-1b", "down-1b", "down-smollm"])
@pytest.mark.parametrize("m", [1, 3, 16, 64])
@pytest.mark.parametrize("form", ["int8", "int8-g32", "int4-g128", "int4-g64-asym", "int4-g32-min"])
def test_real_sizes_on_gpu_with_the_wrappers_own_tiles(form, m, n, k, dtype):
    # The tiles, splits and kernels the wrapper picks for this GPU (576 outputs at M = 1: split-K on an H100).
    g = torch.Generator().manual_seed(m + n + k)
    qw = FORMS[form](torch.randn(n, k, generator=g) * k**-0.5)
    for name in ("qweight", "scales", "zeros"):
        if getattr(qw, name) is not None:
            setattr(qw, name, getattr(qw, name).cuda())
    x = torch.randn(m, k, generator=g).to(device="cuda", dtype=dtype)
    b = torch.randn(n, generator=g).to(device="cuda", dtype=dtype)
    want = x.float() @ dequantize(qw).float().T + b.float()
    got = _run(qw, x, b)
    assert got.dtype == dtype and torch.isfinite(got).all()
    err = (got.float() - want).abs().max().item()
    assert err <= (2e-2 if dtype == torch.bfloat16 else 5e-3) * want.abs().max().item()
    assert torch.equal(_run(qw, x, b), got)  # deterministic, split-K included
