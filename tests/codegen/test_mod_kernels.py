"""The Mixture-of-Depths kernels (codegen/mod.py) against their reference ops, interpreted at odd shapes.

Every output buffer is poisoned before each run (NaN for floats, -7 for indices), so an element the kernel fails
to write shows up; inputs are fresh and seeded per case (drawn on the CPU, then moved to the test device: CUDA when
the GPU suite runs this file, the CPU with TRITON_INTERPRET=1 otherwise).
"""

from __future__ import annotations

import pytest
import torch

from kiln.codegen.mod import mod_gather, mod_route, mod_scatter
from kiln.compile.lowering import KERNEL_TABLE
from kiln.ir.ops_mod import mod_rows

ops = torch.ops.kiln
NAMES = ("r", "index", "count", "xs", "xpos")
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _t(values: list[float], dtype: torch.dtype = torch.float32) -> torch.Tensor:
    return torch.tensor(values, dtype=dtype, device=DEVICE)


def _poisoned(b: int, t: int, rows: int, d: int, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    i64 = dict(dtype=torch.int64, device=DEVICE)
    return {"r": torch.full((b, t), float("nan"), device=DEVICE), "index": torch.full((b, rows), -7, **i64),
            "count": torch.full((b,), -7, **i64), "xpos": torch.full((b, rows), -7, **i64),
            "xs": torch.full((b, rows, d), float("nan"), dtype=dtype, device=DEVICE)}


def _case(b: int, t: int, d: int, seed: int, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(b, t, d, generator=g).to(DEVICE, dtype)
    positions = (torch.arange(t) + torch.randint(0, 50, (b, 1), generator=g)).contiguous().to(DEVICE)  # offset/seq
    weight = (torch.randn(1, d, generator=g) * d**-0.5).to(DEVICE, dtype)
    return g, x, positions, weight


def _same(got: tuple, want: tuple, names: tuple[str, ...]) -> None:
    for name, o, w in zip(names, got, want, strict=True):
        assert o.shape == w.shape and o.dtype == w.dtype, f"{name}: {o.dtype}{list(o.shape)} vs {w.dtype}"
        if o.is_floating_point():
            assert torch.isfinite(o).all(), f"{name} has unwritten (NaN) elements"
            torch.testing.assert_close(o, w, atol=2e-6, rtol=2e-6, msg=name)
        else:
            assert torch.equal(o, w), f"{name}: {o} vs {w}"


@pytest.mark.parametrize(("b", "t", "d", "threshold"), [(1, 1, 8, -9.0), (2, 37, 40, 0.05), (3, 70, 200, 0.0),
                                                        (2, 19, 24, 9.0)])
def test_mod_route_kernel_equals_the_reference(b, t, d, threshold):
    _, x, positions, weight = _case(b, t, d, seed=t)
    bias, thr = _t([0.02]), _t([threshold])
    want = ops.mod_route(x, positions, weight, bias, thr)
    out = _poisoned(b, t, t, d, x.dtype)
    got = mod_route(x, positions, weight, bias, thr, out=out)
    assert all(got[i] is out[n] for i, n in enumerate(NAMES))
    _same(got, want, NAMES)
    counts = want[2].tolist()
    if threshold == 0.0:
        assert all(0 < c < t for c in counts) and len(set(counts)) > 1, counts  # partial, and differs by sequence
    elif threshold > 1:
        assert counts == [0] * b  # nothing routes: every row is padding
    elif threshold < -1:
        assert counts == [t] * b


@pytest.mark.parametrize(("b", "t", "d", "capacity"), [(2, 37, 40, 0.3), (3, 45, 72, 1.0), (1, 9, 16, 0.125)])
def test_mod_gather_kernel_equals_the_reference(b, t, d, capacity):
    g, x, positions, _ = _case(b, t, d, seed=d)
    score = torch.randn(b, t, generator=g).to(DEVICE)
    for mask in (ops.mod_topk_mask(score, capacity), score > 0.3):
        rows = mod_rows(capacity, t) if capacity < 1 else t
        if capacity < 1 and int(mask.sum(-1).max()) > rows:
            continue  # a threshold mask with more rows than the top-k capacity is not a graph the pass makes
        want = ops.mod_gather(x, positions, mask, capacity)
        got = mod_gather(x, positions, mask, rows, out=_poisoned(b, t, rows, d, x.dtype))
        _same(got, want, NAMES[1:])


@pytest.mark.parametrize(("b", "t", "d"), [(2, 37, 40), (3, 70, 200), (1, 5, 8)])
def test_mod_scatter_kernel_equals_the_reference(b, t, d):
    g, x, positions, weight = _case(b, t, d, seed=b * t)
    r, index, count, xs, _ = ops.mod_route(x, positions, weight, _t([1.0]), _t([1.0]))
    ys = xs + torch.randn(xs.shape, generator=g).to(DEVICE)
    want = ops.mod_scatter(x, ys, r, index, count)
    poisoned = torch.full_like(x, float("nan"))
    got = mod_scatter(x, ys, r, index, count, out=poisoned)
    assert got is poisoned
    _same((got,), (want,), ("out",))
    routed = torch.zeros(b, t, dtype=torch.bool, device=DEVICE)
    for s in range(b):
        routed[s, index[s, : count[s]]] = True
    assert torch.equal(got[~routed], x[~routed]) and not torch.equal(got[routed], x[routed])


def test_kernels_launch_from_the_lowering_table_in_bf16():
    _, x, positions, weight = _case(2, 23, 48, seed=4, dtype=torch.bfloat16)
    args = (x, positions, weight, _t([0.0], torch.bfloat16), _t([0.0], torch.bfloat16))
    want, got = ops.mod_route(*args), KERNEL_TABLE[ops.mod_route.default](*args)
    _same(got, want, NAMES)
    mask = (torch.rand(2, 23, generator=torch.Generator().manual_seed(1)) < 0.4).to(DEVICE)
    _same(KERNEL_TABLE[ops.mod_gather.default](x, positions, mask, 1.0), ops.mod_gather(x, positions, mask, 1.0),
          NAMES[1:])


@pytest.mark.parametrize(("name", "form"), [("tiny-llama-mod", "causal"), ("tiny-mistral-mod", "training")])
def test_compiled_mod_model_on_kernels_equals_the_level1_reference(name, form):
    from kiln.compile.driver import compile_model
    from kiln.ir.frontend import build_graph
    from kiln.spec.loader import load_spec

    loaded = load_spec(name)
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, 512, (2, 11), generator=g).to(DEVICE)
    positions = torch.arange(11, device=DEVICE).expand(2, 11).contiguous()
    want = build_graph(loaded.model, mod_form=form, device=DEVICE)(tokens, positions)
    compiled = compile_model(build_graph(loaded.model, mod_form=form, device=DEVICE), loaded.compile, use_kernels=True)
    assert compiled.passes[0] == "mod_routing"
    assert {"mod_route", "mod_scatter", "flash_attn"} <= {k.template for k in compiled.kernels}
    got = compiled(tokens, positions)
    if DEVICE == "cuda":  # fp32 tl.dot may run in tf32 there: the GPU suite's bound (tests/codegen/test_gpu_kernels.py)
        assert (got - want).abs().max().item() < 1e-4 * want.abs().max().item()
    else:
        torch.testing.assert_close(got, want, atol=2e-5, rtol=2e-5)


def test_kiln_compile_reports_the_routed_layers_and_the_form(capsys):
    from kiln.cli.commands import main

    assert main(["compile", "tiny-llama-mod"]) == 0
    err = capsys.readouterr().err
    assert "Mixture-of-Depths routes layers 1, 3 (capacity 0.5, decide = threshold); compiled in the causal form" in err
    assert "passes: mod_routing, gqa_fusion" in err
