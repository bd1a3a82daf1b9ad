"""The quantized-linear kernels (quant_gemv / quant_gemm templates) against dequantize-then-matmul in fp32.

Odd shapes (N and K not powers of two, groups of 32), M = 1, 3, 17 through both kernels, outputs poisoned
with NaN before every run.
"""

import pytest
import torch

from kiln.errors import CodegenError
from kiln.quant.formats import QuantScheme, dequantize, quantize_rtn

SCHEMES = {
    "int8": QuantScheme(bits=8),
    "int4-g32": QuantScheme(bits=4, group=32),
    "int4-g32-asym": QuantScheme(bits=4, group=32, symmetric=False),
}
SHAPES = [(72, 96), (40, 160), (24, 416)]  # (N, K); K = 416 loops more than once in both kernels


def _case(scheme: QuantScheme, m: int, n: int, k: int, bias: bool, dtype=torch.float32):
    g = torch.Generator().manual_seed(m * 1000 + n + k)
    w = torch.randn(n, k, generator=g)
    qw = quantize_rtn(w, scheme)
    x = torch.randn(m, k, generator=g).to(dtype)
    b = torch.randn(n, generator=g).to(dtype) if bias else None
    want = x.double() @ dequantize(qw).double().T + (b.double() if bias else 0)
    return qw, x, b, want.float()


def _run(qw, x, b, kernel, out=None):
    from kiln.codegen.quant import linear_w4, linear_w8

    if qw.bits == 8:
        return linear_w8(x, qw.qweight, qw.scales, b, out=out, kernel=kernel)
    return linear_w4(x, qw.qweight, qw.scales, qw.zeros, qw.group, b, out=out, kernel=kernel)


@pytest.mark.parametrize("kernel", ["quant_gemv", "quant_gemm"])
@pytest.mark.parametrize("m", [1, 3, 17])
@pytest.mark.parametrize("n,k", SHAPES)
@pytest.mark.parametrize("name", sorted(SCHEMES))
def test_kernel_equals_dequantize_then_matmul(name, n, k, m, kernel):
    qw, x, b, want = _case(SCHEMES[name], m, n, k, bias=(m == 3))
    out = torch.full((m, n), float("nan"))
    got = _run(qw, x, b, kernel, out=out)
    assert got is out
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("m", [1, 17])
def test_wrapper_picks_kernel_by_m_and_keeps_leading_dims(m, monkeypatch):
    import kiln.codegen.quant as quant

    launched = []
    real = quant.launch
    monkeypatch.setattr(quant, "launch", lambda template, *a: (launched.append(template), real(template, *a)))
    qw, x, b, want = _case(SCHEMES["int4-g32"], m, 40, 96, bias=False)
    got = _run(qw, x.view(1, m, 96), b, None)
    assert launched == ["quant_gemv" if m <= quant.GEMV_MAX_M else "quant_gemm"]
    assert got.shape == (1, m, 40)
    torch.testing.assert_close(got[0], want, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("kernel", ["quant_gemv", "quant_gemm"])
@pytest.mark.parametrize("name", ["int8", "int4-g32"])
def test_bf16_activations_come_back_bf16(name, kernel):
    qw, x, b, want = _case(SCHEMES[name], 5, 72, 96, bias=True, dtype=torch.bfloat16)
    got = _run(qw, x, b, kernel)
    assert got.dtype == torch.bfloat16
    # bf16 inputs and output: one bf16 step of the output (plus the weight's rounding to bf16 in the GEMM).
    torch.testing.assert_close(got.float(), want, rtol=3e-2, atol=5e-2)


def test_bad_inputs_are_codegen_errors():
    from kiln.codegen.quant import linear_w4, linear_w8

    qw = quantize_rtn(torch.randn(40, 96), SCHEMES["int4-g32"])
    x = torch.randn(2, 96)
    with pytest.raises(CodegenError, match="K a multiple of the group"):
        linear_w4(x, qw.qweight, qw.scales, None, 64)
    with pytest.raises(CodegenError, match="x has 95 features"):
        linear_w4(torch.randn(2, 95), qw.qweight, qw.scales, None, 32)
    with pytest.raises(CodegenError, match="qweight has dtype"):
        linear_w8(x, qw.qweight, qw.scales.flatten())
    with pytest.raises(CodegenError, match="unknown quantized-linear kernel"):
        linear_w4(x, qw.qweight, qw.scales, None, 32, kernel="cublas")
