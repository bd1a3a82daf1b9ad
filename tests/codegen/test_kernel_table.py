"""Every entry of lowering's KERNEL_TABLE against its reference op, from one table of example inputs.

On CPU the generated kernels run in Triton's interpreter at small, odd shapes (fp32); under the `gpu` marker
the same table runs at real sizes in bf16 and fp16. A new kernel in KERNEL_TABLE without an example here
fails `test_every_kernel_has_an_example`.
"""

from __future__ import annotations

import pytest
import torch

from kiln.compile.lowering import KERNEL_TABLE
from tests.support.kernel_examples import kernel_examples


def test_every_kernel_has_an_example():
    assert set(KERNEL_TABLE) == set(kernel_examples("small", torch.float32, "cpu"))


def _check(op, size: str, dtype: torch.dtype, device: str, tol: float) -> None:
    build = kernel_examples(size, dtype, device)[op]
    if build is None:
        pytest.skip("covered with its cache set-up in tests/codegen/test_kernels_paged.py")
    args = build()
    want = op(*args)  # the reference implementation registered with the op
    got = KERNEL_TABLE[op](*args)
    want, got = (want, got) if isinstance(want, (tuple, list)) else ((want,), (got,))
    for w, o in zip(want, got, strict=True):
        assert o.shape == w.shape and o.dtype == w.dtype, f"{op}: {o.dtype}{list(o.shape)} vs {w.dtype}{list(w.shape)}"
        if not w.is_floating_point():  # token ids, indices, counts and masks: exact at any size
            assert torch.equal(o, w), f"{op}: integer outputs differ"
            continue
        assert torch.isfinite(o).all()
        err = (o.float() - w.float()).abs().max().item()
        assert err <= tol * max(w.float().abs().max().item(), 1.0), f"{op}: max error {err}"


@pytest.mark.parametrize("op", list(KERNEL_TABLE), ids=lambda op: op.name())
def test_kernel_equals_its_reference_op(op):
    _check(op, "small", torch.float32, "cpu", 2e-4)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("op", list(KERNEL_TABLE), ids=lambda op: op.name())
def test_kernel_equals_its_reference_op_at_real_size_on_gpu(op, dtype):
    _check(op, "real", dtype, "cuda", 2e-2 if dtype == torch.bfloat16 else 5e-3)
