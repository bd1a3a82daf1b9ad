"""A quantized lm_head (`quantize = int4(lm_head = true)` / `int8(lm_head = true)`, tied or untied) in the serving
step graph: the kv_cache pass took only a plain kiln::linear as the graph output, so every `kiln run` of such a
spec failed. The engine's greedy tokens must equal uncached generation on the same quantized model graph."""

from __future__ import annotations

import pytest

from kiln import reference
from kiln.build import load_model
from kiln.compile.driver import compile_model
from kiln.llm import LLM, SamplingParams

SPEC = """\
model "q" {
  vocab = 256 dim = 64 layers = 2 heads = 4 kv_heads = 2 ffn = 128 context = 64
  norm = rms(eps = 1e-5)
  rope = rope(theta = 10000)
  tie_embeddings = TIE
  layer {
    x = x + attention(norm(x))
    x = x + mlp(norm(x), act = swiglu)
  }
}
compile { quantize = SCHEME }
"""
PROMPT = [5, 17, 33, 2, 9, 101, 64, 7, 88, 3]


@pytest.mark.parametrize("tie", ["true", "false"])
@pytest.mark.parametrize("scheme", ["int4(group = 32, lm_head = true)", "int8(lm_head = true)"])
def test_engine_matches_uncached_reference_with_a_quantized_lm_head(tmp_path, tie, scheme):
    path = tmp_path / "q.kiln"
    path.write_text(SPEC.replace("TIE", tie).replace("SCHEME", scheme))
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    lm = load_model(path, device="cpu", seed=0)
    passed = compile_model(lm.gm, lm.compile, use_kernels=False)  # the model pipeline: quantize included
    assert any("linear_w" in str(n.target) and n.name == "logits" for n in passed.gm.graph.nodes)
    want = reference.generate(passed.gm, PROMPT, params, context=lm.model.context).token_ids
    llm = LLM(path, seed=0, device="cpu", use_kernels=False)
    got = llm.generate([PROMPT], params)[0].outputs[0].token_ids
    assert list(got) == list(want)
