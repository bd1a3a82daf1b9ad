"""Every Triton launch passes the kernel's arguments by keyword (name=value), so a misordered stride cannot bind to
the wrong parameter and compute garbage silently.

Two checks: the launcher sources (codegen/ and lowering) read as an AST, where a `kernel[grid](...)` call may not
take positional arguments and a `launch(...)` call must hand its kernel arguments over as a dict; and every host
wrapper run once with its kernels replaced by a probe that refuses positional arguments and compares the keyword
names with the real kernel's parameters (the probe launches nothing: what the kernels compute is checked against
the reference ops by test_kernel_table.py and the kernel tests).
"""

from __future__ import annotations

import ast
from pathlib import Path
from typing import Any

import pytest
import torch

from kiln.codegen import _host, act, flash_attn, mod, norm, paged, quant, rope, spec_verify
from kiln.codegen.render import template_names
from kiln.errors import InternalError
from kiln.quant.formats import parse_scheme, quantize_rtn

ROOT = Path(__file__).resolve().parents[2]
LAUNCHER_SOURCES = sorted((ROOT / "codegen").glob("*.py")) + [ROOT / "compiler" / "compile" / "lowering.py"]


# ---- the sources ---------------------------------------------------------------------------------------------


def _is_dict(node: ast.AST, dicts: set[str]) -> bool:
    """A dict display, a dict(...) call or a name bound to one of those in the same function."""
    if isinstance(node, ast.Dict):
        return True
    if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "dict":
        return not node.args  # dict(name=value, **parts): keywords only
    return isinstance(node, ast.Name) and node.id in dicts


def positional_launches(source: str, filename: str) -> list[str]:
    """Lines where a kernel is launched with positional arguments: `k[grid](a, b)` or `launch(..., (a, b), ...)`."""
    bad = []
    tree = ast.parse(source, filename)
    scopes = [n for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))] or [tree]
    for scope in scopes:
        dicts: set[str] = set()
        for node in ast.walk(scope):  # names bound to dicts anywhere in the function (one pass is enough here)
            if isinstance(node, ast.Assign) and _is_dict(node.value, set()):
                dicts |= {t.id for t in node.targets if isinstance(t, ast.Name)}
        for node in ast.walk(scope):
            if not isinstance(node, ast.Call):
                continue
            where = f"{Path(filename).name}:{node.lineno}"
            if isinstance(node.func, ast.Subscript) and node.args:  # kernel[grid](...)
                bad.append(f"{where}: kernel[grid](...) with {len(node.args)} positional argument(s)")
            name = node.func.id if isinstance(node.func, ast.Name) else getattr(node.func, "attr", None)
            if name == "launch":
                given = node.args[3] if len(node.args) > 3 else next(
                    (k.value for k in node.keywords if k.arg == "args"), None)
                if given is None or not _is_dict(given, dicts):
                    bad.append(f"{where}: launch(...) kernel arguments not passed as a dict of name=value")
    return bad


def test_launcher_sources_pass_kernel_arguments_by_keyword():
    found = {p.name: positional_launches(p.read_text(), str(p)) for p in LAUNCHER_SOURCES}
    assert not [line for lines in found.values() for line in lines]
    launching = [name for name, text in ((p.name, p.read_text()) for p in LAUNCHER_SOURCES) if "launch(" in text]
    assert {"norm.py", "rope.py", "act.py", "flash_attn.py", "paged.py", "quant.py"} <= set(launching)


@pytest.mark.parametrize(
    "source",
    [
        "def f(kernel, grid, x, n):\n    kernel[grid](x, n, BLOCK=16)\n",
        "def f(x, n):\n    args = (x, n)\n    launch('norm', 'rms_norm', (1,), args, {}, {})\n",
        "def f(x, n):\n    launch('norm', 'rms_norm', (1,), [x, n], {}, {})\n",
        "def f(x, n):\n    launch('norm', 'rms_norm', (1,), dict(x, n=n), {}, {})\n",
    ],
    ids=["subscript-call", "tuple-name", "list", "dict-positional"],
)
def test_the_source_check_catches_a_positional_launch(source):
    assert positional_launches(source, "example.py")


def test_the_source_check_accepts_keyword_launches():
    source = (
        "def f(kernel, grid, x, n, parts):\n"
        "    args = dict(x_ptr=x, n=n, **parts)\n"
        "    launch('norm', 'rms_norm', (1,), args, {}, {})\n"
        "    launch('norm', 'rms_norm', (1,), {'x_ptr': x}, {}, {})\n"
        "    kernel[grid](**args, BLOCK=16)\n"
    )
    assert positional_launches(source, "example.py") == []


# ---- every wrapper, run -----------------------------------------------------------------------------------------


class _Probe:
    """Stands in for a loaded kernel: records each launch's keywords and refuses positional arguments."""

    def __init__(self, template: str, kernel: Any, launches: list):
        self.template, self.arg_names, self.launches = template, list(kernel.arg_names), launches

    def __getitem__(self, grid: tuple[int, ...]):
        def run(*args: Any, **kwargs: Any) -> None:
            assert not args, f"{self.template}: {len(args)} positional kernel argument(s)"
            options = {"num_warps", "num_stages", "enable_fp_fusion"}
            names = sorted(k for k in kwargs if k not in options)
            assert names == sorted(self.arg_names), f"{self.template}: launched with {names}, has {self.arg_names}"
            self.launches.append(self.template)

        return run


@pytest.fixture
def launches(monkeypatch) -> list[str]:
    seen: list[str] = []
    real = _host.load_kernel

    def load(template: str, name: str, **params: Any) -> _Probe:
        return _Probe(template, real(template, name, **params), seen)

    monkeypatch.setattr(_host, "load_kernel", load)
    return seen


def _run_every_wrapper() -> None:
    g = torch.Generator().manual_seed(0)
    r = lambda *s: torch.randn(*s, generator=g)  # noqa: E731
    x, w = r(3, 40), r(40)
    norm.rms_norm(x, w, 1e-5, residual=r(3, 40))
    norm.head_rms_norm(r(3, 5 * 8), r(8), 1e-6)
    norm.layer_norm(x, w, r(40), 1e-5)
    rope.rope(r(1, 5, 4 * 16), torch.arange(5)[None], torch.rand(8))
    rope.qk_norm_rope(r(1, 5, 8 * 16)[..., : 6 * 16], r(16), r(16), 4 * 16, 1e-6, torch.arange(5)[None], torch.rand(8))
    act.gated_act(r(3, 52), r(3, 52), "silu")
    act.act(r(3, 52), "relu")
    flash_attn.flash_attention(r(1, 5, 4 * 16), r(1, 7, 2 * 16), r(1, 7, 2 * 16), 4, 2, True, 3, 0.25)
    for kv_dtype in (torch.float32, torch.int8):
        cache = torch.zeros(1, 2, 4, 4, 2, 16, dtype=kv_dtype)
        scales = torch.ones(1, 2, 4, 4, 2) if kv_dtype == torch.int8 else None
        tables, ctx = torch.tensor([[1, 2], [3, 0]], dtype=torch.int32), torch.tensor([5, 2], dtype=torch.int32)
        for new in ((1, 1), (3, 2)):  # one new token per sequence (decode + merge), then a prefill chunk
            n = sum(new)
            qsl = torch.tensor([0, new[0], n], dtype=torch.int32)
            paged.paged_attention(r(1, n, 4 * 16), r(1, n, 2 * 16), r(1, n, 2 * 16), cache, 0,
                                  torch.arange(n, dtype=torch.int64), tables, ctx, qsl, max(new), 5, 4, 2, True, 0,
                                  0.25, scales)  # fmt: skip
    for rows in (2, 9):  # GEMV up to quant.GEMV_MAX_M rows, GEMM above
        q8 = quantize_rtn(r(24, 64), parse_scheme("int8"))
        quant.linear_w8(r(rows, 64), q8.qweight, q8.scales, r(24))
        q4 = quantize_rtn(r(24, 64), parse_scheme("int4-g32-asym"))
        quant.linear_w4(r(rows, 64), q4.qweight, q4.scales, q4.zeros, 32)
    split = quant.QuantTile("quant_gemv", 1, 8, 32, split_k=2)  # split-K: partials, then quant_reduce
    quant.linear_w4(r(1, 64), q4.qweight, q4.scales, q4.zeros, 32, r(24), tile=split)
    x, pos = r(2, 9, 24), torch.arange(9).expand(2, 9).contiguous()
    score, index, count, xs, _ = mod.mod_route(x, pos, r(1, 24) * 0.2, r(1), torch.zeros(1))
    mod.mod_gather(x, pos, torch.rand(2, 9, generator=g) < 0.5, 9)
    mod.mod_scatter(x, xs, score, index, count)
    probs = torch.softmax(r(2, 3, 11), -1)
    for draft_probs in (None, torch.softmax(r(2, 2, 11), -1)):  # deterministic drafts, then a model drafter's
        spec_verify.spec_verify(probs, torch.randint(0, 11, (2, 2), generator=g), draft_probs,
                                torch.tensor([2, 1], dtype=torch.int32), torch.rand(2, 2, generator=g),
                                torch.empty(2, 11).exponential_(generator=g))


def test_every_wrapper_launches_its_kernel_by_keyword_with_every_parameter_named(launches):
    _run_every_wrapper()
    missing = sorted(set(template_names()) - set(launches))
    assert not missing, f"templates whose wrappers _run_every_wrapper does not call yet: {missing}; add a call"


def test_a_misnamed_keyword_is_caught_at_launch(monkeypatch):
    """Triton's interpreter drops unknown keywords silently; the launch's own name check does not."""
    real = norm.launch

    def misnamed(template, op, grid, args, consts, options):
        args = dict(args)
        args["stride_residual"] = args.pop("stride_res")
        real(template, op, grid, args, consts, options)

    monkeypatch.setattr(norm, "launch", misnamed)
    with pytest.raises(InternalError, match=r"missing \['stride_res'\] and unknown \['stride_residual'\]"):
        norm.rms_norm(torch.randn(3, 40), torch.randn(40), 1e-5, residual=torch.randn(3, 40))


def test_a_positional_launch_is_refused():
    with pytest.raises(InternalError, match="by name"):
        _host.launch("act", "act", (1,), (torch.zeros(4), torch.zeros(4), torch.zeros(4), 4),
                     {"ACT": "relu", "GATED": False, "BLOCK_SIZE": 1024}, {"num_warps": 4})  # fmt: skip
