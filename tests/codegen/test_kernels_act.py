"""The activation kernels (codegen/templates/act.py.j2) against kiln's reference act / gated_act."""

import pytest
import torch

from kiln.errors import CodegenError
from kiln.ir import ops

KINDS = ["silu", "gelu", "gelu_tanh", "relu"]


@pytest.mark.parametrize("shape", [(1, 1, 7), (2, 17, 131), (3, 1, 1531)])
@pytest.mark.parametrize("kind", KINDS)
def test_gated_act_matches_reference(kind, shape):
    from kiln.codegen.act import gated_act

    torch.manual_seed(sum(shape))
    gate = torch.randn(shape) * 3
    up = torch.randn(shape)
    out = torch.full_like(gate, float("nan"))
    got = gated_act(gate, up, kind, out=out)
    assert got is out
    torch.testing.assert_close(got, ops.gated_act(gate, up, kind), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("kind", KINDS)
def test_act_matches_reference(kind):
    from kiln.codegen.act import act

    torch.manual_seed(3)
    x = torch.randn(3, 5, 77) * 4
    out = torch.full_like(x, float("nan"))
    torch.testing.assert_close(act(x, kind, out=out), ops.act(x, kind), rtol=1e-5, atol=1e-5)


def test_gated_act_bf16_close():
    from kiln.codegen.act import gated_act

    torch.manual_seed(4)
    gate = torch.randn(2, 7, 131, dtype=torch.bfloat16) * 3
    up = torch.randn_like(gate)
    # The interpreter truncates fp32 -> bf16 where GPUs round to nearest: allow one bf16 step.
    torch.testing.assert_close(gated_act(gate, up, "silu"), ops.gated_act(gate, up, "silu"), rtol=2e-2, atol=2e-2)


def test_act_rejects_bad_inputs():
    from kiln.codegen.act import act, gated_act

    x = torch.randn(4, 8)
    with pytest.raises(CodegenError, match="unknown activation 'swish'"):
        act(x, "swish")
    with pytest.raises(CodegenError, match="up shape"):
        gated_act(x, torch.randn(4, 9), "silu")
    with pytest.raises(CodegenError, match="up has dtype"):
        gated_act(x, x.double(), "silu")
    with pytest.raises(CodegenError, match="gate must be contiguous"):
        gated_act(torch.randn(4, 16)[:, :8], x, "silu")
