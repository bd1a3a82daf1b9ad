"""A small valid spec and helpers to edit it and read the errors kiln reports for the edit."""

from __future__ import annotations

import pytest

from kiln.errors import Diagnostic, SpecError
from kiln.spec.loader import parse_and_resolve

BASE = """\
model "t" {
  vocab = 512
  dim = 64
  layers = 2
  heads = 4
  kv_heads = 2
  ffn = 128
  context = 256
  norm = rms(eps = 1e-5)
  rope = rope(theta = 10000)
  layer {
    x = x + attention(norm(x), causal = true)
    x = x + mlp(norm(x), act = swiglu)
  }
}
compile {
  dtype = fp32
}
"""


def edit(old: str, new: str) -> str:
    assert old in BASE, old
    return BASE.replace(old, new, 1)


def diagnostics(text: str) -> list[Diagnostic]:
    with pytest.raises(SpecError) as info:
        parse_and_resolve(text, "t.kiln")
    return info.value.diagnostics


def only(text: str) -> Diagnostic:
    diags = diagnostics(text)
    assert len(diags) == 1, [d.render() for d in diags]
    return diags[0]
