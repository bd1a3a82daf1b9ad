"""ModelRunner.warmup: kernels run (so Triton compiles them) while the model loads, touching only the null block."""

import torch

import kiln.codegen.paged as paged
from kiln.compile.step import compile_step
from kiln.ir.frontend import build_graph
from kiln.runtime.block_manager import NULL_BLOCK, BlockManager
from kiln.runtime.model_runner import ModelRunner
from kiln.spec.loader import load_spec


def test_warmup_runs_prefill_and_decode_kernels_on_the_null_block_only(monkeypatch, capsys):
    cfg = load_spec("tiny-llama").model
    model = compile_step(build_graph(cfg, seed=0), cfg, use_kernels=True)
    launched = []
    real = paged.launch
    monkeypatch.setattr(paged, "launch", lambda t, *a: (launched.append(t), real(t, *a)))
    runner = ModelRunner(model, BlockManager(40, 4), max_num_seqs=4, max_model_len=64, warmup=True)
    assert {"paged_kv_write", "paged_prefill", "paged_decode", "paged_merge"} <= set(launched)
    assert "kiln: compiling kernels" in capsys.readouterr().err
    data = runner.kv_cache.data
    assert data[:, :, NULL_BLOCK].abs().sum() > 0  # the warm-up wrote its K/V there
    others = torch.ones(data.shape[2], dtype=torch.bool)
    others[NULL_BLOCK] = False
    assert not data[:, :, others].any()  # and nowhere else
    assert all(c <= 64 and q <= c for _, q, c in runner.warmup_shapes())


def test_no_warmup_on_cpu_by_default():
    cfg = load_spec("tiny-llama").model
    model = compile_step(build_graph(cfg, seed=0), cfg, use_kernels=False)
    runner = ModelRunner(model, BlockManager(40, 4), max_num_seqs=4, max_model_len=64)
    assert not runner.kv_cache.data.any()
