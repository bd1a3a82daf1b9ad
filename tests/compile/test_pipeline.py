"""The pass driver: ordering from requirements, ill-formed pipelines, debug-mode checks and dumps."""

from __future__ import annotations

import pytest
import torch
from torch import fx

from kiln.compile.pipeline import (
    DEFAULT_PIPELINE,
    STEP_PIPELINE,
    Pass,
    PassResult,
    build_pipeline,
    check_order,
    known_passes,
    run_pipeline,
)
from kiln.errors import InternalError, KilnError, PassError, WeightError
from kiln.ir.frontend import build_graph
from kiln.model_config import CompileConfig, ModConfig
from kiln.spec.loader import load_spec


def noop(name: str, requires: tuple[str, ...] = ()) -> Pass:
    return Pass(name, lambda gm: PassResult(gm, False), requires)


@pytest.fixture(scope="module")
def cfg():
    return load_spec("tiny-llama").model


def names(passes: list[Pass]) -> list[str]:
    return [p.name for p in passes]


def test_registry_finds_every_pass_file():
    assert set(DEFAULT_PIPELINE) <= set(known_passes())
    for p in known_passes().values():
        assert p.doc.strip(), f"pass {p.name} has no docstring"


def test_default_pipeline_order():
    assert names(build_pipeline()) == list(DEFAULT_PIPELINE)


def test_step_pipeline_is_the_literal_list_in_order():
    assert names(build_pipeline(step=True)) == [n for n in STEP_PIPELINE if n not in ("quantize", "mod_routing")]
    comp = CompileConfig(extra={"quantize": "int8", "route": ModConfig(capacity=0.5)})
    assert names(build_pipeline(comp, step=True)) == list(STEP_PIPELINE)
    assert STEP_PIPELINE.index("mod_routing") < STEP_PIPELINE.index("kv_cache")  # the routed KV cache needs it


def test_requirements_are_checked_not_reordered():
    a, b, c, d = noop("a"), noop("b", requires=("c",)), noop("c"), noop("d")
    check_order([a, c, b, d])
    check_order([d, c, b, a])
    with pytest.raises(PassError, match="'b' requires pass 'c' to run before it.*a -> b -> c -> d"):
        check_order([a, b, c, d])


def test_config_order_cannot_break_a_requirement():
    comp = CompileConfig(extra={"passes": ["rope_fusion", "flash_tiling", "gqa_fusion"]})
    with pytest.raises(PassError, match="'rope_fusion' requires pass 'gqa_fusion' to run before it"):
        build_pipeline(comp)
    comp = CompileConfig(extra={"passes": ["flash_tiling", "gqa_fusion", "rope_fusion"]})
    assert names(build_pipeline(comp)) == ["flash_tiling", "gqa_fusion", "rope_fusion"]  # the order written


def test_overrides_and_disable_list():
    comp = CompileConfig(extra={"disable_passes": ["norm_fusion"]})
    assert "norm_fusion" not in names(build_pipeline(comp))
    assert "norm_fusion" in names(build_pipeline(comp, {"norm_fusion": True}))
    assert "flash_tiling" not in names(build_pipeline(None, {"flash_tiling": False}))


def test_cycle_error_names_the_cycle():
    registry = {"x": noop("x", ("y",)), "y": noop("y", ("z",)), "z": noop("z", ("x",)), "w": noop("w")}
    with pytest.raises(PassError, match="'x' requires pass 'y' to run before it") as e:
        build_pipeline(CompileConfig(extra={"passes": ["w", "x", "y", "z"]}), registry=registry)
    assert "w -> x -> y -> z" in str(e.value)  # a requirement cycle has no order that passes the check


def test_missing_requirement_names_both_passes():
    with pytest.raises(PassError, match="'rope_fusion' requires pass 'gqa_fusion'"):
        build_pipeline(None, {"gqa_fusion": False})


def test_unknown_pass_is_an_error():
    with pytest.raises(PassError, match="unknown pass.*no_such_pass"):
        build_pipeline(None, {"no_such_pass": True})


def _dead_node(gm: fx.GraphModule) -> PassResult:
    out = next(n for n in gm.graph.nodes if n.op == "output")
    with gm.graph.inserting_before(out):
        gm.graph.call_function(torch.ops.kiln.add.default, (out.args[0], out.args[0]))
    return PassResult(gm, True)


def _foreign_op(gm: fx.GraphModule) -> PassResult:
    out = next(n for n in gm.graph.nodes if n.op == "output")
    with gm.graph.inserting_before(out):
        new = gm.graph.call_function(torch.sin, (out.args[0],))
    out.args = (new,)
    return PassResult(gm, True)


def _liar(gm: fx.GraphModule) -> PassResult:
    _foreign_op(gm)
    return PassResult(gm, False)


def _raises(gm: fx.GraphModule) -> PassResult:
    raise RuntimeError("boom")


@pytest.mark.parametrize(
    "run, why",
    [(_dead_node, "dead"), (_foreign_op, "neither a kiln op"), (_liar, "modified=False"), (_raises, "boom")],
    ids=["dead-node", "foreign-op", "untruthful-modified", "raises"],
)
def test_debug_mode_names_the_broken_pass_and_the_passes_before_it(cfg, run, why):
    """A pass that breaks the IR or raises is kiln's bug: InternalError (not a KilnError, so the CLI keeps the
    traceback), naming the pass and the ones before it."""
    passes = build_pipeline(None, {"flash_tiling": False}) + [Pass("broken", run)]
    with pytest.raises(InternalError) as e:
        run_pipeline(build_graph(cfg), passes, debug=True)
    msg = str(e.value)
    assert "'broken'" in msg and why in msg
    assert "after gqa_fusion, rope_fusion, norm_fusion" in msg and "this is a bug in kiln" in msg
    assert not isinstance(e.value, KilnError) and e.value.__cause__ is not None  # the original traceback is kept


def test_a_user_error_inside_a_pass_stays_a_kiln_error(cfg):
    def refuses(gm):
        raise WeightError("layers.0.mlp.up.weight: K = 100 is not a multiple of the group 32; use group 4")

    with pytest.raises(PassError, match="'refuses' failed \\(the first pass\\): layers.0.mlp.up.weight: K = 100"):
        run_pipeline(build_graph(cfg), [Pass("refuses", refuses)])


def test_debug_off_skips_the_ir_check(cfg):
    """Without KILN_DEBUG the driver trusts the pass: the dead node it left (which the check refuses with debug on,
    see above) is still in the graph, neither reported nor cleaned up."""
    gm = run_pipeline(build_graph(cfg), [Pass("broken", _dead_node)], debug=False)
    dead = [n for n in gm.graph.nodes if n.op == "call_function" and not n.users]
    assert [n.target for n in dead] == [torch.ops.kiln.add.default]


def test_first_pass_failure_says_so(cfg):
    with pytest.raises(InternalError, match="'broken' failed \\(the first pass\\)"):
        run_pipeline(build_graph(cfg), [Pass("broken", _raises)], debug=True)


def test_dump_dir_env_writes_one_file_per_pass(cfg, tmp_path, monkeypatch):
    monkeypatch.setenv("KILN_DUMP_DIR", str(tmp_path))
    passes = build_pipeline()
    run_pipeline(build_graph(cfg), passes)
    files = sorted(p.name for p in tmp_path.iterdir())
    assert files == ["00_input.txt"] + [f"{i:02d}_{p.name}.txt" for i, p in enumerate(passes, start=1)]
    text = (tmp_path / "01_gqa_fusion.txt").read_text()
    assert text.startswith("# after gqa_fusion") and "layers.0.attn0.qkv.weight" in text
    assert "kiln.flash_attention" in (tmp_path / f"{len(passes):02d}_flash_tiling.txt").read_text()


def test_pipeline_output_matches_level1(cfg):
    ref = build_graph(cfg)
    tokens = torch.randint(0, cfg.vocab, (2, 6), generator=torch.Generator().manual_seed(0))
    positions = torch.arange(6).expand(2, 6)
    gm = run_pipeline(build_graph(cfg), build_pipeline(), debug=True)
    torch.testing.assert_close(gm(tokens, positions), ref(tokens, positions), atol=1e-5, rtol=1e-5)
