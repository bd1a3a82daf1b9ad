"""The `route = mod(...)` model key: resolution into ModConfig, errors at file:line:col, fmt, check, weights."""

from __future__ import annotations

import pytest

from kiln.cli.commands import main
from kiln.model_config import ModConfig, param_shapes
from kiln.spec.formatter import format_spec
from kiln.spec.limits import param_count
from kiln.spec.loader import load_spec, parse_and_resolve
from kiln.spec.parser import parse_spec
from tests.support.spec_errors import BASE, diagnostics, only

ROUTE_LINE = "  norm = rms(eps = 1e-5)\n"


def routed(route: str, base: str = BASE) -> str:
    assert ROUTE_LINE in base
    return base.replace(ROUTE_LINE, ROUTE_LINE + f"  route = {route}\n", 1)


@pytest.mark.parametrize(
    ("route", "want"),
    [
        ("mod(capacity = 0.125, every = 2, decide = threshold)", ModConfig(0.125, 2, "threshold", 0)),
        ("mod(capacity = 1)", ModConfig(1.0, 2, "threshold", 0)),
        ("mod(capacity = 0.5, every = 1, decide = predictor(hidden = 128))", ModConfig(0.5, 1, "predictor", 128)),
    ],
)
def test_route_resolves_into_mod_config(route, want):
    model = parse_and_resolve(routed(route), "t.kiln").model
    assert model.route == want
    assert isinstance(model.route.capacity, float)


def test_dense_spec_has_no_route():
    assert parse_and_resolve(BASE, "t.kiln").model.route is None


# (route value, message, column of the offending text (line 10), text the hint contains)
ERRORS = {
    "capacity above 1": ("mod(capacity = 1.5)", "capacity must be a number in (0, 1], got 1.5", 26, "fraction"),
    "capacity zero": ("mod(capacity = 0)", "capacity must be a number in (0, 1], got 0", 26, "fraction"),
    "capacity negative": ("mod(capacity = -0.5)", "capacity must be a number in (0, 1], got -0.5", 26, "fraction"),
    "capacity missing": ("mod(every = 2)", "mod() needs `capacity = ...`", 11, "capacity = 0.125"),
    "every zero": ("mod(capacity = 0.5, every = 0)", "every must be a positive integer, got 0", 39, "at least 1"),
    "every fraction": ("mod(capacity = 0.5, every = 1.5)", "every must be a positive integer, got 1.5", 39,
                       "whole number"),
    "every above layers": ("mod(capacity = 0.5, every = 3)", "every = 3 is above layers (2), so no layer would be "
                           "routed", 39, "every <= 2"),
    "hidden missing": ("mod(capacity = 0.5, decide = predictor())", "predictor() needs `hidden = ...`", 40,
                       "hidden = 128"),
    "hidden zero": ("mod(capacity = 0.5, decide = predictor(hidden = 0))", "hidden must be a positive integer, "
                    "got 0", 59, "at least 1"),
    "unknown argument": ("mod(capacity = 0.5, evry = 2)", "unknown argument `evry` to mod(); did you mean `every`?",
                         31, "mod() takes: capacity, every, decide"),
    "unknown decide": ("mod(capacity = 0.5, decide = thresh)", "unknown decide `thresh`; did you mean "
                       "`threshold`?", 40, "threshold(...)"),
    "unknown router": ("moe(capacity = 0.5)", "unknown route `moe`; did you mean `mod`?", 11, "mod(...)"),
    "not a call": ("0.5", "route must be a call like mod(capacity = 0.125, every = 2, decide = threshold), got 0.5",
                   11, "route = mod("),
}


@pytest.mark.parametrize("case", list(ERRORS))
def test_route_error(case):
    route, message, column, hint = ERRORS[case]
    d = only(routed(route))
    assert (d.message, d.line, d.column) == (message, 10, column), d.render()
    assert hint in d.hint
    assert d.path == "t.kiln"


def test_route_errors_come_together():
    diags = diagnostics(routed("mod(capacity = 2, every = 0, decide = predictor(hidden = 0), x = 1)"))
    assert sorted(d.message.split(",")[0] for d in diags) == [
        "capacity must be a number in (0", "every must be a positive integer", "hidden must be a positive integer",
        "unknown argument `x` to mod()"]
    assert {d.line for d in diags} == {10}


def test_route_needs_causal_attention():  # refused for every model now, routed or not: one error, at the value
    d = only(routed("mod(capacity = 0.5)", BASE.replace("causal = true", "causal = false")))
    assert "causal = false" in d.message and (d.line, d.column) == (13, 41)


def test_fmt_round_trips_the_route():
    text = routed("mod(capacity = 0.125, every = 2, decide = predictor(hidden = 128))")
    ast = parse_spec(text, "t.kiln")
    formatted = format_spec(ast)
    assert "  route = mod(capacity = 0.125, every = 2, decide = predictor(hidden = 128))\n" in formatted
    assert parse_spec(formatted, "t.kiln") == ast
    assert format_spec(parse_spec(formatted, "t.kiln")) == formatted


@pytest.mark.parametrize("name", ["tiny-llama-mod", "tiny-mistral-mod"])
def test_bundled_mod_specs_are_canonical_and_routed(name):
    loaded = load_spec(name)
    assert format_spec(loaded.ast) == open(loaded.path).read()
    assert loaded.model.route is not None and loaded.model.layers == 4


def test_check_reports_the_routed_layers(capsys):
    assert main(["check", "tiny-llama-mod", "tiny-mistral-mod", "tiny-llama"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0].endswith("; Mixture-of-Depths routes layers 1, 3 (capacity 0.5, decide = threshold)")
    assert out[1].endswith("; Mixture-of-Depths routes layers 1, 3 (capacity 0.5, decide = predictor(hidden = 32))")
    assert "Mixture-of-Depths" not in out[2]


def test_param_shapes_list_the_routers_of_routed_layers_only():
    model = load_spec("tiny-mistral-mod").model
    shapes = param_shapes(model)
    routers = {n: s for n, s in shapes.items() if ".router." in n}
    want = {}
    for i in (1, 3):
        p = f"layers.{i}.router"
        want |= {f"{p}.weight": (1, 64), f"{p}.bias": (1,), f"{p}.threshold": (1,),
                 f"{p}.predictor.fc1.weight": (32, 64), f"{p}.predictor.fc1.bias": (32,),
                 f"{p}.predictor.fc2.weight": (1, 32), f"{p}.predictor.fc2.bias": (1,)}
    assert routers == want
    names = list(shapes)  # next to the layer's own tensors: after layer 1's, before layer 2's
    assert names.index("layers.1.router.weight") > names.index("layers.1.mlp0.down.weight")
    assert names.index("layers.1.router.weight") < names.index("layers.2.norm0.weight")
    threshold_only = param_shapes(load_spec("tiny-llama-mod").model)
    assert not any(".predictor." in n for n in threshold_only) and "layers.3.router.threshold" in threshold_only


@pytest.mark.parametrize("name", ["tiny-llama-mod", "tiny-mistral-mod"])
def test_param_count_counts_routers(name):
    model = load_spec(name).model
    assert param_count(model) == sum(_numel(s) for s in param_shapes(model).values())


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n
