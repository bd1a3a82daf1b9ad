"""A `kiln train-router` file served: `--routers` on kiln run / serve / bench throughput and LLM(routers=...) attach
the routers to the dense model, and the engine then serves the routed model kiln's reference computes."""

from __future__ import annotations

import dataclasses
import json
import time

import pytest
import torch

from kiln.build import load_model
from kiln.cli.commands import main
from kiln.errors import KilnError
from kiln.ir.frontend import build_graph
from kiln.llm import LLM
from kiln.model_config import ModConfig, param_shapes
from kiln.reference import generate
from kiln.runtime.sampling_params import SamplingParams
from kiln.train.router_files import save_routers
from tests.support.gguf_helper import write_tiny_gguf

PROMPT = [5, 17, 3, 99, 42, 8, 61, 7, 23]


def _routers(tmp_path, spec: str = "tiny-llama", decide: str = "threshold"):
    """A routers file for `spec` with random routers (about half the tokens pass each routed layer), and the routed
    model's reference graph built from the dense weights and those routers."""
    m = load_model(spec, None, dtype="fp32", device="cpu")
    routed = dataclasses.replace(m.model, route=ModConfig(0.5, 2, decide, 8 if decide == "predictor" else 0))
    g = torch.Generator().manual_seed(3)
    tensors = {n: torch.randn(s, generator=g) * 0.5 for n, s in param_shapes(routed).items() if ".router." in n}
    path = save_routers(tmp_path / "routers.safetensors", routed, tensors)
    ref = build_graph(routed, {**{n: p.detach() for n, p in m.gm.named_parameters()}, **tensors}, mod_form="causal")
    return path, routed, ref


@pytest.mark.parametrize("decide", ["threshold", "predictor"])
def test_llm_serves_the_routed_model_of_a_routers_file(tmp_path, decide):
    path, routed, ref = _routers(tmp_path, decide=decide)
    want = generate(ref, PROMPT, SamplingParams(temperature=0, max_tokens=12), context=routed.context).token_ids
    dense = generate(build_graph(dataclasses.replace(routed, route=None),
                                 {n: p for n, p in ref.named_parameters() if ".router." not in n}),
                     PROMPT, SamplingParams(temperature=0, max_tokens=12), context=routed.context).token_ids
    assert want != dense  # the routers change the output, so equal tokens below prove they were attached
    llm = LLM("tiny-llama", dtype="fp32", device="cpu", routers=path)
    assert llm.loaded.model.route == routed.route
    out = llm.generate(prompt_token_ids=[PROMPT], sampling_params=SamplingParams(temperature=0, max_tokens=12))
    assert out[0].outputs[0].token_ids == want


def test_kiln_run_routers_flag(tmp_path, capsys):
    path, routed, ref = _routers(tmp_path)
    want = generate(ref, PROMPT, SamplingParams(temperature=0, max_tokens=8), context=routed.context).token_ids
    rc = main(["run", "tiny-llama", "--device", "cpu", "--dtype", "fp32", "--routers", str(path), "--prompt-ids",
               ",".join(map(str, PROMPT)), "--max-tokens", "8", "--temperature", "0", "--json"])
    assert rc == 0
    cap = capsys.readouterr()
    assert json.loads(cap.out)["token_ids"] == want
    assert "routers.safetensors: Mixture-of-Depths routes layers 1 (capacity 0.5, decide = threshold)" in cap.err
    assert "routed KV cache" in cap.err


def test_routers_with_quantize_quantize_the_routed_model(tmp_path):
    path, routed, _ = _routers(tmp_path)
    m = load_model("tiny-llama", None, dtype="fp32", device="cpu", quantize="int8", routers=path)
    assert m.model.route == routed.route and m.compile.extra["quantize"].label == "int8"
    assert any(".router." in n for n, _ in m.gm.named_parameters())


def test_a_missing_routers_file_fails_before_the_weights_load(tmp_path, capsys):
    t0 = time.perf_counter()
    rc = main(["run", "smollm2-135m", "--routers", str(tmp_path / "nope.safetensors"), "--prompt", "hi"])
    assert rc == 2 and time.perf_counter() - t0 < 10  # the 135M GGUF is never read
    assert "no such file" in capsys.readouterr().err


def test_routers_on_a_routed_spec_or_quantized_checkpoint_are_refused(tmp_path):
    path, _, _ = _routers(tmp_path)
    with pytest.raises(KilnError, match="already routed"):
        load_model("tiny-llama-mod", None, dtype="fp32", device="cpu", routers=path)
    q = tmp_path / "q"
    assert main(["quantize", "tiny-llama", "--quantize", "int8", "-o", str(q)]) == 0
    with pytest.raises(KilnError, match="`kiln quantize` checkpoint.*original checkpoint"):
        load_model(None, q, device="cpu", routers=path)


def test_a_gguf_with_routers_is_dequantized_and_routed(tmp_path):
    gguf = tmp_path / "tiny.gguf"
    write_tiny_gguf(gguf, linear_type="Q8_0")
    dense = load_model(None, gguf, dtype="fp32", device="cpu", quantize="none")
    routed = dataclasses.replace(dense.model, route=ModConfig(0.5, 2))
    tensors = {n: torch.zeros(s) for n, s in param_shapes(routed).items() if ".router." in n}
    path = save_routers(tmp_path / "r.safetensors", routed, tensors)
    m = load_model(None, gguf, dtype="fp32", device="cpu", routers=path)
    assert m.model.route == routed.route
    with pytest.raises(KilnError, match="quantize 'gguf' keeps"):
        load_model(None, gguf, dtype="fp32", device="cpu", quantize="gguf", routers=path)
