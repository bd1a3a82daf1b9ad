"""Every kiln op keeps its plain reference function (kiln.ir.registry), which kiln.train differentiates through."""

import torch

import kiln.compile.lowering  # noqa: F401  (imports every op module)
from kiln.ir.registry import REFERENCE


def test_every_kiln_op_is_registered_with_its_reference_function():
    names = {n.split(".")[0] for n in torch._C._dispatch_get_all_op_names() if n.startswith("kiln::")}
    assert names and names == set(REFERENCE), f"registered without kiln_op: {sorted(names - set(REFERENCE))}"


def test_the_reference_function_is_what_the_op_computes():
    x, w = torch.randn(3, 8), torch.rand(8) + 0.5
    torch.testing.assert_close(REFERENCE["kiln::rms_norm"](x, w, 1e-5), torch.ops.kiln.rms_norm(x, w, 1e-5))
    x.requires_grad_(True)
    REFERENCE["kiln::rms_norm"](x, w, 1e-5).sum().backward()  # the op itself has no autograd formula
    assert x.grad is not None and torch.isfinite(x.grad).all()
