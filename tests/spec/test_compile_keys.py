"""The compile keys `kv_cache = paged(block = ..., dtype = ...)` and `attention = flash(...) | reference`: what they
resolve to, their errors (message, line:col, hint), and how the pipeline, compile_step, the engine and LLM use them."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from kiln.compile.pipeline import build_pipeline, run_pipeline
from kiln.compile.step import compile_step
from kiln.errors import SpecError
from kiln.ir.frontend import build_graph
from kiln.runtime.engine import Engine
from kiln.spec.loader import load_spec, parse_and_resolve
from tests.support.spec_errors import edit, only

kiln_ops = torch.ops.kiln


def with_keys(*lines: str) -> str:
    return edit("  dtype = fp32\n", "  dtype = fp32\n" + "".join(f"  {line}\n" for line in lines))


def extra(*lines: str) -> dict:
    return parse_and_resolve(with_keys(*lines), "t.kiln").compile.extra


VALID = {
    "kv_cache = paged": {"kv_cache": {"block": 16, "dtype": "auto"}},
    "kv_cache = paged(block = 16)": {"kv_cache": {"block": 16, "dtype": "auto"}},
    "kv_cache = paged(block = 1, dtype = int8)": {"kv_cache": {"block": 1, "dtype": "int8"}},
    "kv_cache = paged(dtype = auto, block = 256)": {"kv_cache": {"block": 256, "dtype": "auto"}},
    "attention = flash": {"attention": {"kind": "flash", "tile": None}},
    "attention = flash(tiles = auto)": {"attention": {"kind": "flash", "tile": None}},
    "attention = reference": {"attention": {"kind": "reference"}},
    "attention = flash(block_m = 64, block_n = 32)": {
        "attention": {"kind": "flash", "tile": {"block_m": 64, "block_n": 32, "num_warps": 4, "num_stages": 2}}},
    "attention = flash(block_m = 16, block_n = 128, warps = 8, stages = 3)": {
        "attention": {"kind": "flash", "tile": {"block_m": 16, "block_n": 128, "num_warps": 8, "num_stages": 3}}},
}


@pytest.mark.parametrize("line", VALID)
def test_valid_keys_resolve_into_extra(line):
    assert extra(line) == VALID[line]


# (compile line, expected message, column, text the hint contains); the line is always 18
ERRORS = {
    "block not a power of two": ("kv_cache = paged(block = 12)", "block must be a power of two from 1 to 256, got 12",
                                 28, "aligned with the attention kernels' power-of-two key tiles"),
    "block zero": ("kv_cache = paged(block = 0)", "block must be a power of two from 1 to 256, got 0", 28,
                   "block = 16"),
    "block too big": ("kv_cache = paged(block = 512)", "block must be a power of two from 1 to 256, got 512", 28,
                      "tokens per KV cache block"),
    "kv dtype": ("kv_cache = paged(dtype = fp8)", "unknown KV cache dtype `fp8`", 28, "dtype is one of: auto, int8"),
    "kv dtype typo": ("kv_cache = paged(dtype = int)", "unknown KV cache dtype `int`; did you mean `int8`?", 28,
                      "auto, int8"),
    "kv_cache kind": ("kv_cache = contiguous", "unknown kv_cache `contiguous`", 14, "paged(...)"),
    "kv_cache number": ("kv_cache = 16", "kv_cache must be a call like paged(block = 16), got 16", 14,
                        "kv_cache = paged(block = 16)"),
    "kv_cache unknown arg": ("kv_cache = paged(size = 16)", "unknown argument `size` to paged()", 20, "block, dtype"),
    "attention kind": ("attention = flesh", "unknown attention `flesh`; did you mean `flash`?", 15, "reference(...)"),
    "tiles not auto": ("attention = flash(tiles = fast)", "unknown tiles choice `fast`", 29, "tiles is one of: auto"),
    "tiles and a fixed tile": ("attention = flash(tiles = auto, block_m = 64, block_n = 64)",
                               "tiles = auto and a fixed tile (block_m = ...) contradict each other", 45,
                               "remove tiles = auto to pin the tile"),
    "block_m not a power of two": ("attention = flash(block_m = 48, block_n = 64)",
                                   "block_m must be a power of two from 16 to 256, got 48", 31,
                                   "tl.dot needs at least 16"),
    "block_n too small": ("attention = flash(block_m = 64, block_n = 8)",
                          "block_n must be a power of two from 16 to 256, got 8", 45, "keys per tile"),
    "missing block_n": ("attention = flash(block_m = 64)", "a fixed flash tile needs `block_n = ...`", 15,
                        "flash(block_m = 64, block_n = 64"),
    "warps": ("attention = flash(block_m = 64, block_n = 64, warps = 3)", "warps must be one of 1, 2, 4, 8, 16, got 3",
              57, "warps per program"),
    "stages": ("attention = flash(block_m = 64, block_n = 64, stages = 0)",
               "stages must be an integer from 1 to 8, got 0", 58, "software-pipelining depth"),
    "reference takes nothing": ("attention = reference(tiles = auto)", "unknown argument `tiles` to reference()", 25,
                                "reference() takes no arguments"),
}


@pytest.mark.parametrize("case", ERRORS)
def test_error(case):
    line, message, column, hint = ERRORS[case]
    text = with_keys(line)
    d = only(text)
    assert d.message == message
    assert (d.path, d.line, d.column) == ("t.kiln", 18, column)
    assert hint in d.hint
    assert d.source_line == text.splitlines()[17]


def test_bad_keys_are_reported_together():
    text = with_keys("kv_cache = paged(block = 3, dtype = fp8)", "attention = flash(block_m = 8, block_n = 64)")
    first = r"^t\.kiln:18:28: error: block must be a power of two from 1 to 256, got 3\n"
    with pytest.raises(SpecError, match=first) as info:
        parse_and_resolve(text, "t.kiln")
    assert [(d.line, d.column, d.message) for d in info.value.diagnostics] == [
        (18, 28, "block must be a power of two from 1 to 256, got 3"),
        (18, 39, "unknown KV cache dtype `fp8`"),
        (19, 31, "block_m must be a power of two from 16 to 256, got 8")]
    # one message names all three, each with its place
    assert [line for line in str(info.value).splitlines() if ": error: " in line] == [
        "t.kiln:18:28: error: block must be a power of two from 1 to 256, got 3",
        "t.kiln:18:39: error: unknown KV cache dtype `fp8`",
        "t.kiln:19:31: error: block_m must be a power of two from 16 to 256, got 8"]


def _spec(*lines: str):
    loaded = parse_and_resolve(with_keys(*lines), "t.kiln")
    return loaded.model, loaded.compile


def test_attention_reference_turns_flash_tiling_off_and_a_fixed_tile_pins_it():
    cfg, comp = _spec("attention = reference")
    assert "flash_tiling" not in [p.name for p in build_pipeline(comp)]
    assert "flash_tiling" in [p.name for p in build_pipeline(comp, {"flash_tiling": True})]  # CLI flags still win
    cfg, comp = _spec("attention = flash(block_m = 64, block_n = 16, warps = 2, stages = 1)")
    gm = run_pipeline(build_graph(cfg, seed=0), build_pipeline(comp))
    flash = gm.graph.find_nodes(op="call_function", target=kiln_ops.flash_attention.default)
    assert flash and all(n.args[8:] == (64, 16, 2, 1) for n in flash)
    cfg, comp = _spec("attention = flash(tiles = auto)")
    gm = run_pipeline(build_graph(cfg, seed=0), build_pipeline(comp))
    assert all(n.args[8:] == (32, 32, 4, 1) for n in gm.graph.find_nodes(
        op="call_function", target=kiln_ops.flash_attention.default))  # the interpreter's default tile


def test_compile_step_takes_the_kv_cache_key_and_the_fixed_tile():
    from kiln.compile.kernel_requests import kernel_requests

    cfg, comp = _spec("kv_cache = paged(block = 8, dtype = int8)",
                      "attention = flash(block_m = 16, block_n = 16, warps = 2, stages = 1)")
    step = compile_step(build_graph(cfg, seed=0), cfg, comp, use_kernels=True)
    assert (step.kv_dtype, step.dtype, step.block_size) == (torch.int8, torch.float32, 8)
    assert "kv_scales" in [n.name for n in step.gm.graph.find_nodes(op="placeholder")]
    prefill = [r for r in kernel_requests(step.gm) if r.template == "paged_prefill"]
    assert prefill and all(r.params["tile"]["BLOCK_M"] == 16 and r.params["tile"]["num_warps"] == 2 for r in prefill)
    assert all(r.params["params"]["KV_QUANT"] for r in prefill)
    engine = Engine(step, None, cfg, num_blocks=40)
    assert engine.block_manager.block_size == 8 and engine.runner.kv_cache.scales is not None
    assert Engine(step, None, cfg, num_blocks=70, block_size=4).block_manager.block_size == 4  # callers override
    fp = compile_step(build_graph(cfg, seed=0), cfg, comp, use_kernels=False, kv_cache_dtype="auto")
    assert fp.kv_dtype == torch.float32 and fp.block_size == 8


def test_llm_uses_the_spec_block_and_kv_dtype_unless_overridden(tmp_path):
    from kiln import LLM, SamplingParams

    path = tmp_path / "t.kiln"
    text = Path(load_spec("tiny-llama").path).read_text()
    path.write_text(text.replace("  dtype = fp32\n", "  dtype = fp32\n  kv_cache = paged(block = 32, dtype = int8)\n"))
    llm = LLM(str(path), device="cpu", use_kernels=False, num_blocks=20)
    assert llm.engine.block_manager.block_size == 32 and llm.step_model.kv_dtype == torch.int8
    out = llm.generate("Hi", SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))
    assert len(out[0].outputs[0].token_ids) == 4
    llm = LLM(str(path), device="cpu", use_kernels=False, num_blocks=20, block_size=16, kv_cache_dtype="auto")
    assert llm.engine.block_manager.block_size == 16 and llm.step_model.kv_dtype == torch.float32


def test_real_bundled_specs_show_the_keys():
    for name in ("llama-3.2-1b", "llama-3.1-8b", "mistral-7b-v0.1", "qwen2.5-0.5b", "gpt2"):
        comp = load_spec(name).compile
        assert comp.extra["kv_cache"] == {"block": 16, "dtype": "auto"}
        assert comp.extra["attention"] == {"kind": "flash", "tile": None}
