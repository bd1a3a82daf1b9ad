"""The whole compiled model (passes + generated kernels, interpreted on CPU) against the Level-1 graph and HF."""

from __future__ import annotations

import operator

import pytest
import torch

from kiln.codegen._host import BoundKernels
from kiln.codegen.cache import cache_stats
from kiln.compile.driver import compile_model, emit
from kiln.compile.lowering import KERNEL_TABLE
from kiln.hf.config import config_from_hf, load_hf_config
from kiln.hf.weights import load_hf_weights
from kiln.ir.frontend import build_graph
from kiln.spec.loader import load_spec
from tests.support.hf_models import prompts, save_hf_model

SPECS = ("tiny-llama", "tiny-mistral", "tiny-qwen2", "tiny-qwen3", "tiny-gpt2")


def close(got: torch.Tensor, want: torch.Tensor) -> bool:
    return (got - want).abs().max().item() < 1e-4 * want.abs().max().item()


def batch(vocab: int, b: int = 2, t: int = 11) -> tuple[torch.Tensor, torch.Tensor]:
    return prompts(vocab, batch=b, length=t), torch.arange(t).expand(b, t).contiguous()


@pytest.mark.parametrize("spec", SPECS)
def test_compiled_equals_level1(spec):
    cfg = load_spec(spec).model
    tokens, positions = batch(cfg.vocab)
    with torch.no_grad():
        want = build_graph(cfg)(tokens, positions)
        compiled = compile_model(build_graph(cfg), load_spec(spec).compile, use_kernels=True)
        got = compiled(tokens, positions)
    assert compiled.use_kernels and compiled.kernels
    kernel_fns = set(KERNEL_TABLE.values())
    allowed = {operator.getitem, torch.ops.aten.split_with_sizes.default}
    for node in compiled.gm.graph.nodes:
        if node.op == "call_function":
            bound = isinstance(node.target, BoundKernels) and node.target.fn in kernel_fns
            assert bound or node.target in allowed, f"%{node.name} was not lowered to a bound kernel call"
    assert close(got, want), (got - want).abs().max()


def test_second_compile_renders_nothing():
    cfg = load_spec("tiny-llama").model
    compile_model(build_graph(cfg), use_kernels=True)
    renders = cache_stats().renders
    again = compile_model(build_graph(cfg), use_kernels=True)
    assert again.misses == 0 and again.hits == len(again.kernels) > 0
    assert cache_stats().renders == renders


def test_without_kernels_runs_the_level2_references():
    cfg = load_spec("tiny-qwen2").model
    tokens, positions = batch(cfg.vocab)
    compiled = compile_model(build_graph(cfg), use_kernels=False)
    assert not compiled.use_kernels and compiled.kernels == [] and compiled.hits == compiled.misses == 0
    assert close(compiled(tokens, positions), build_graph(cfg)(tokens, positions))


@pytest.mark.parametrize("family", ["llama", "mistral", "qwen2", "qwen3"])
def test_compiled_equals_hf(family, tmp_path):
    hf = save_hf_model(family, tmp_path, hidden_size=64)  # head_dim 16: the smallest the flash kernel takes
    cfg = config_from_hf(load_hf_config(tmp_path))
    gm = build_graph(cfg, load_hf_weights(tmp_path, cfg, model_type=family))
    tokens, positions = batch(cfg.vocab)
    with torch.no_grad():
        want = hf(tokens).logits
        got = compile_model(gm, use_kernels=True)(tokens, positions)
    assert close(got, want), (got - want).abs().max()


def test_emit_writes_graphs_and_kernels(tmp_path):
    cfg = load_spec("tiny-gpt2").model
    written = emit(build_graph(cfg, device="meta"), tmp_path)
    graphs = sorted(p.name for p in (tmp_path / "graphs").iterdir())
    assert graphs == ["00_input.txt", "01_gqa_fusion.txt", "02_rope_fusion.txt", "03_norm_fusion.txt",
                      "04_flash_tiling.txt", "05_lowered.txt"]
    kernels = sorted((tmp_path / "kernels").iterdir())
    assert {p.name.split("_", 1)[1] for p in kernels} == {
        "norm_layer_norm.py", "flash_attn_attention.py", "act_act.py"
    }
    for path in kernels:
        text = path.read_text()
        assert text.startswith("# kiln emit: launched by")
        assert "# tile: " in text and "@triton.jit" in text and "float32[1, 8," in text
        compile(text, str(path), "exec")  # valid Python
    assert set(written) == {*(tmp_path / "graphs").iterdir(), *kernels}
    assert "k_flash_attention" in (tmp_path / "graphs" / "05_lowered.txt").read_text()
