"""Small torch modules for the torch.compile backend tests."""

from __future__ import annotations

import torch


class Unknown(torch.nn.Module):
    """Nothing kiln knows: cumulative sums, flips, reductions, a broadcasting product."""

    def __init__(self):
        super().__init__()
        self.scale = torch.nn.Parameter(torch.randn(7))

    def forward(self, x):
        y = torch.cumsum(torch.sin(x) * self.scale, dim=-1).flip(0)
        return y - y.amax(dim=-1, keepdim=True) + x.abs().mean()
