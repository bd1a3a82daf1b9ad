"""`kiln quantize` of a Mixture-of-Depths model (threshold and predictor routing) writes a checkpoint that loads and
generates what `--quantize` of the same scheme at run time generates: its spec.kiln keeps the route, and it is
quantized after the passes the pipeline runs first (mod_routing, gqa_fusion). A checkpoint that does not fit says
which passes it was written after and which this kiln runs, rather than blaming the spec."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch

from kiln.cli.commands import main
from kiln.errors import WeightError
from kiln.spec.loader import load_spec

PROMPTS = [[5, 9, 77, 300, 12, 8, 100, 101, 7], [3, 3, 3], list(range(40, 80))]


def _quantize(*argv: str) -> None:
    assert main(["quantize", *argv, "--device", "cpu"]) == 0


def _greedy(llm) -> list[list[int]]:
    from kiln import SamplingParams

    params = SamplingParams(max_tokens=16, temperature=0)
    return [o.outputs[0].token_ids for o in llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params)]


def _quantized_tensors(gm: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {k: v for k, v in gm.state_dict().items() if k.endswith((".qweight", ".scales", ".zeros"))}


@pytest.mark.parametrize(("spec", "scheme"), [("tiny-llama-mod", "int8"), ("tiny-llama-mod", "int4-gptq-g32"),
                                              ("tiny-mistral-mod", "int4-gptq-g32")])
def test_a_routed_models_checkpoint_runs_as_run_time_quantization(spec, scheme, tmp_path, capsys):
    from kiln import LLM

    out = tmp_path / "q"
    _quantize(spec, "--quantize", scheme, "-o", str(out))
    assert load_spec(out / "spec.kiln").model == load_spec(spec).model  # the route included
    assert json.loads((out / "quantization.json").read_text())["passes"] == ["mod_routing", "gqa_fusion"]
    at_run_time, stored = LLM(spec, quantize=scheme), LLM(str(out))
    want, got = _quantized_tensors(at_run_time.step_model.gm), _quantized_tensors(stored.step_model.gm)
    assert got.keys() == want.keys() and all(torch.equal(got[k], want[k]) for k in got)  # GPTQ calibrated alike
    assert _greedy(stored) == _greedy(at_run_time)
    capsys.readouterr()


def _write_routed(tmp_path, *, route_in_spec: bool, route_first: bool):
    """tiny-llama-mod quantized int8 and saved by hand: route_in_spec False / route_first False as kiln wrote it
    before (spec.kiln without `route`, routed layers quantized in the dense-masked form)."""
    from kiln.compile.pipeline import quantize_graph
    from kiln.compile.quantized import save_quantized
    from kiln.ir.frontend import build_graph

    cfg = load_spec("tiny-llama-mod").model
    gm = quantize_graph(build_graph(cfg), "int8", route=route_first)
    save_quantized(gm, tmp_path, cfg if route_in_spec else dataclasses.replace(cfg, route=None))
    return cfg


def test_a_checkpoint_written_without_the_route_names_it_and_loads_with_the_routed_spec(tmp_path):
    from kiln.build import load_model
    from kiln.compile.quantized import load_quantized

    cfg = _write_routed(tmp_path, route_in_spec=False, route_first=False)
    with pytest.raises(WeightError) as info:
        load_quantized(tmp_path)
    message = str(info.value)
    assert "router weights" in message and "left `route` out of spec.kiln" in message
    assert "give the routed model's spec" in message and "another spec" not in message
    assert load_model("tiny-llama-mod", tmp_path, device="cpu").model == cfg  # the spec given supplies the route


def test_a_pass_list_that_differs_from_this_kilns_is_named_not_blamed_on_the_spec(tmp_path):
    from kiln.compile.quantized import load_quantized

    _write_routed(tmp_path, route_in_spec=True, route_first=True)
    meta = json.loads((tmp_path / "quantization.json").read_text())
    meta["passes"] = ["gqa_fusion"]  # as if written by a kiln that quantized before routing
    (tmp_path / "quantization.json").write_text(json.dumps(meta))
    with pytest.raises(WeightError) as info:
        load_quantized(tmp_path)
    message = str(info.value)
    assert "written after the passes gqa_fusion" in message
    assert "this kiln quantizes this model after mod_routing, gqa_fusion" in message
    assert "quantize the original model again with this kiln" in message and "another spec" not in message
    meta["passes"] = ["gqa_fusion", "no_such_pass"]
    (tmp_path / "quantization.json").write_text(json.dumps(meta))
    with pytest.raises(WeightError, match="are not passes of this kiln"):
        load_quantized(tmp_path)


def test_a_routed_graph_given_alone_is_routed_before_quantize():
    """bench quality / perplexity hand quantize_graph a graph without saying it is routed: it finds the routed
    layers itself, so GPTQ calibrates on what serving computes; a dense graph runs no mod_routing."""
    from kiln.compile.pipeline import quantize_graph
    from kiln.ir.frontend import build_graph
    from kiln.quant.formats import parse_scheme

    for name, routed in (("tiny-llama-mod", True), ("tiny-llama", False)):
        gm = quantize_graph(build_graph(load_spec(name).model, seed=0), parse_scheme("int8"))
        assert ("mod_routing" in gm.meta["kiln_passes_before_quantize"]) is routed, name
        targets = {str(n.target) for n in gm.graph.nodes}
        assert "kiln.mod_combine.default" not in targets  # routed layers rewritten; a dense graph has none
        assert ("kiln.mod_scatter.default" in targets) is routed
