"""backend="kiln" on modules that change tensors in place (clone then write, `+=`, `.mul_`, ReLU(inplace=True),
writes through views): the compiled module computes what eager does, and writes the caller's tensors as eager
does. Tiny fp32 modules, fallback="eager" with kiln's reference ops: what is checked is the rewrite of the graph
(normalize, regions), not kernels or inductor."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from kiln.dynamo.backend import STATS

OPTIONS = {"fallback": "eager", "use_kernels": False}
D = 16


@pytest.fixture(autouse=True)
def fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def run_both(model: nn.Module, *inputs: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, list, list]:
    """(eager result, compiled result, eager's inputs after the call, compiled's inputs after the call), each
    side on its own copies of the inputs."""
    mine, theirs = [x.clone() for x in inputs], [x.clone() for x in inputs]
    with torch.no_grad():
        want = model(*mine)
        got = torch.compile(model, backend="kiln", options=OPTIONS)(*theirs)
    return want, got, mine, theirs


def check(model: nn.Module, *inputs: torch.Tensor) -> None:
    want, got, mine, theirs = run_both(model, *inputs)
    torch.testing.assert_close(got, want)
    for a, b in zip(theirs, mine, strict=True):
        torch.testing.assert_close(a, b)  # the caller's tensors changed exactly as eager changed them


class Lin(nn.Module):
    def __init__(self, n: int = 1):
        super().__init__()
        self.ls = nn.ModuleList(nn.Linear(D, D) for _ in range(n))


# ---- clone ---------------------------------------------------------------------------------------------------


class CloneThenSetitem(Lin):
    def forward(self, x):
        y = x.clone()
        y[:, 0] = 0
        return self.ls[0](y)


class CloneThenMul(Lin):
    def forward(self, x):
        h = self.ls[0](x)
        y = h.clone()
        y.mul_(2)
        return F.silu(y) + h


class CloneWrittenThroughView(Lin):
    def forward(self, x):
        z = x.clone()
        z[..., : D // 2].zero_()  # a view of the clone: the clone changes
        return self.ls[0](z)


class SourceWrittenAfterClone(Lin):
    def forward(self, x):
        h = self.ls[0](x)
        y = h.clone()
        h.mul_(3)  # the clone keeps the old values
        return F.silu(y) + h


@pytest.mark.parametrize("model", [CloneThenSetitem, CloneThenMul, CloneWrittenThroughView, SourceWrittenAfterClone])
def test_clone_is_a_new_tensor_when_either_side_is_written(model):
    check(model(), torch.randn(2, 3, D))


# ---- regions and in-place ops ---------------------------------------------------------------------------------


class Lin3(Lin):
    """Three linears: one before the write, one reading before it, one reading after it."""

    def __init__(self):
        super().__init__(3)


class ReadWriteRead(Lin3):
    def forward(self, x):
        h = self.ls[0](x).relu()
        a = self.ls[1](h)
        h.mul_(2)
        b = self.ls[2](h)
        return a + b


class InplaceReLUBetween(Lin3):
    def __init__(self):
        super().__init__()
        self.act = nn.ReLU(inplace=True)

    def forward(self, x):
        h = self.ls[0](x)
        a = self.ls[1](h)
        self.act(h)  # result unused: only the write matters
        b = self.ls[2](h)
        return a + b


class WriteThroughView(Lin3):
    def forward(self, x):
        h = self.ls[0](x)
        a = self.ls[1](h)
        h[..., 1:3].mul_(-4)  # a view: writes h
        b = self.ls[2](h)
        return a + b


class WriteTheBaseOfAView(Lin3):
    def forward(self, x):
        h = self.ls[0](x)
        v = h.view(-1, D)
        a = self.ls[1](v)
        h.add_(1)  # the base: v changes
        b = self.ls[2](v)
        return a + b.view_as(a)


@pytest.mark.parametrize("model", [ReadWriteRead, InplaceReLUBetween, WriteThroughView, WriteTheBaseOfAView])
def test_no_read_moves_past_a_write(model):
    first = len(STATS.reports)
    check(model(), torch.randn(2, 3, D))
    (report,) = STATS.reports[first:]
    assert report.counts()["linear"] == 3  # still claimed: only their grouping changed


# ---- augmented assignment ---------------------------------------------------------------------------------------


class IaddKeepsAlias(Lin):
    def __init__(self):
        super().__init__()
        self.norm = nn.LayerNorm(D)

    def forward(self, x):
        h = self.ls[0](x)
        r = h
        h += x
        return self.norm(h) + r  # r is h: it has x added too


class RmsIadd(Lin):
    def __init__(self):
        super().__init__()
        self.weight = nn.Parameter(1 + 0.1 * torch.randn(D))

    def forward(self, x):
        h = self.ls[0](x)
        r = h
        h += x
        v = h.to(torch.float32)
        v = v * torch.rsqrt(v.pow(2).mean(-1, keepdim=True) + 1e-6)
        return self.weight * v.to(x.dtype) + r


class ImulKeepsAlias(Lin):
    def __init__(self):
        super().__init__(2)

    def forward(self, x):
        a = F.silu(self.ls[0](x))
        keep = a
        a *= self.ls[1](x)
        return a + keep


class IaddOnInput(nn.Module):
    def __init__(self):
        super().__init__()
        self.norm = nn.LayerNorm(D)

    def forward(self, x, y):
        x += y
        return self.norm(x)


@pytest.mark.parametrize(
    ("model", "claims"),
    [
        (IaddKeepsAlias, {"linear": 1, "layer_norm": 1}),
        (RmsIadd, {"linear": 1, "rms_norm": 1}),
        (ImulKeepsAlias, {"linear": 2, "act": 1}),
    ],
)
def test_augmented_assignment_keeps_its_write(model, claims):
    first = len(STATS.reports)
    check(model(), torch.randn(2, 3, D))
    (report,) = STATS.reports[first:]
    assert dict(report.counts()) == claims  # the in-place add / mul is not a kiln add / gated_act: others see it


def test_augmented_assignment_on_an_input_writes_the_callers_tensor():
    check(IaddOnInput(), torch.randn(2, 3, D), torch.randn(2, 3, D))


class PrivateIadd(Lin):
    def __init__(self):
        super().__init__()
        self.norm = nn.LayerNorm(D)

    def forward(self, x):
        h = self.ls[0](x)
        h += x  # nothing else sees h: as good as h + x
        return self.norm(h)


def test_augmented_assignment_nothing_else_sees_is_still_claimed():
    first = len(STATS.reports)
    check(PrivateIadd(), torch.randn(2, 3, D))
    (report,) = STATS.reports[first:]
    assert dict(report.counts()) == {"linear": 1, "add": 1, "layer_norm": 1}


class GateWrittenBeforeTheProduct(Lin):
    def __init__(self):
        super().__init__(2)

    def forward(self, x):
        g = self.ls[0](x)
        a = F.silu(g)
        g.mul_(2)  # a keeps silu of the old g: kiln's gated_act(g, up) here would read the new one
        return a * self.ls[1](x) + g


def test_gated_act_does_not_read_a_gate_written_since_the_activation():
    first = len(STATS.reports)
    check(GateWrittenBeforeTheProduct(), torch.randn(2, 3, D))
    (report,) = STATS.reports[first:]
    assert "gated_act" not in report.counts() and report.counts()["act"] == 1
