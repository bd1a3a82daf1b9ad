"""The tile autotuner (codegen/autotune.py): timing with an injected timer, the on-disk cache and its key, the
candidate lists, and the compile report of a second process that renders and tunes nothing."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from kiln.codegen import autotune
from kiln.codegen.tiles import TileConfig, candidate_tiles, default_tile, shared_memory_estimate, shared_memory_limit
from kiln.errors import CodegenError

ROOT = Path(__file__).resolve().parents[2]
CPU = torch.device("cpu")
TILES = [TileConfig(32, 32, 4, 1), TileConfig(16, 16, 4, 1), TileConfig(64, 32, 4, 1)]
PROBLEM = {"dtype": "float16", "head_dim": 64, "causal": True, "window": False}


@pytest.fixture
def tuner(tmp_path, monkeypatch):
    """A private cache directory, an empty memo and fresh counters; the timer reads each launch's fake time."""
    monkeypatch.setenv("KILN_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(autotune, "_memo", {})
    monkeypatch.setattr(autotune, "_stats", autotune.TuneStats())
    times = {TILES[0]: 3.0, TILES[1]: 1.0, TILES[2]: 2.0}
    calls = []

    def timer(fn):
        tile = fn()
        calls.append(tile)
        return times[tile]

    prev = autotune.set_timer(timer)
    yield times, calls, tmp_path
    autotune.set_timer(prev)


def _make_call(tile):
    return lambda: tile


def test_tune_times_every_candidate_once_and_caches_the_fastest(tuner, monkeypatch):
    times, calls, root = tuner
    best = autotune.tune("flash_attn", CPU, PROBLEM, TILES, _make_call)
    assert best == TILES[1] and calls == TILES
    assert (autotune.stats().tuned, autotune.stats().timed, autotune.stats().loaded) == (1, 3, 0)
    [path] = (root / "autotune").glob("flash_attn_*.json")
    data = json.loads(path.read_text())
    assert data["best"] == {"block_m": 16, "block_n": 16, "num_warps": 4, "num_stages": 1}
    assert data["problem"] == PROBLEM and data["device"] == "triton-interpreter" and len(data["timings_ms"]) == 3
    # The same process asks again: the memo answers; a new process (empty memo) reads the file; neither times.
    assert autotune.tune("flash_attn", CPU, PROBLEM, TILES, _make_call) == TILES[1]
    monkeypatch.setattr(autotune, "_memo", {})
    assert autotune.tune("flash_attn", CPU, PROBLEM, TILES, _make_call) == TILES[1]
    assert len(calls) == 3 and autotune.stats().loaded == 1
    assert "1 tuned (3 configs timed), 1 loaded from the cache" in autotune.stats().summary()


def test_a_tuning_file_is_readable_as_its_directory_and_an_unwritable_one_only_warns(tuner, monkeypatch, caplog):
    _, calls, root = tuner
    (root / "autotune").mkdir(mode=0o755)
    os.chmod(root / "autotune", 0o755)
    autotune.tune("flash_attn", CPU, PROBLEM, TILES, _make_call)
    [path] = (root / "autotune").glob("flash_attn_*.json")
    assert path.stat().st_mode & 0o777 == 0o644  # a shared cache: other users read it instead of tuning again
    blocked = root / "blocked"
    blocked.write_text("a file where the cache directory should be")
    monkeypatch.setenv("KILN_CACHE_DIR", str(blocked))
    monkeypatch.setattr(autotune, "_memo", {})
    with caplog.at_level("WARNING", logger="kiln"):
        assert autotune.tune("flash_attn", CPU, PROBLEM, TILES, _make_call) == TILES[1]  # tuned, not cached
    assert "cannot write autotune cache file" in caplog.text and len(calls) == 6


def test_key_changes_with_problem_candidates_template_and_triton(tuner, monkeypatch):
    key = autotune.problem_key("flash_attn", CPU, PROBLEM, TILES)
    assert key == autotune.problem_key("flash_attn", CPU, dict(PROBLEM), list(TILES))
    assert key != autotune.problem_key("flash_attn", CPU, {**PROBLEM, "head_dim": 128}, TILES)
    assert key != autotune.problem_key("flash_attn", CPU, PROBLEM, TILES[:2])
    assert key != autotune.problem_key("paged_prefill", CPU, PROBLEM, TILES)
    monkeypatch.setattr(autotune, "template_sources", lambda family: ["an edited template"])
    assert key != autotune.problem_key("flash_attn", CPU, PROBLEM, TILES)
    monkeypatch.undo()
    monkeypatch.setattr(autotune, "triton_version", lambda: "0.0.1")
    assert key != autotune.problem_key("flash_attn", CPU, PROBLEM, TILES)


def test_failing_candidates_lose_and_all_failing_is_an_error(tuner, monkeypatch):
    times, calls, root = tuner

    def make_call(tile):
        if tile == TILES[1]:
            raise RuntimeError("out of shared memory")
        return lambda: tile

    assert autotune.tune("flash_attn", CPU, PROBLEM, TILES, make_call) == TILES[2]
    assert autotune.stats().failed == 1

    def broken(tile):
        raise RuntimeError("no such device")

    with pytest.raises(CodegenError, match="none of the 3 candidate tiles ran.*no such device"):
        autotune.tune("flash_attn", CPU, {**PROBLEM, "head_dim": 32}, TILES, broken)


def test_a_torn_cache_file_is_tuned_again(tuner, monkeypatch):
    times, calls, root = tuner
    autotune.tune("flash_attn", CPU, PROBLEM, TILES, _make_call)
    [path] = (root / "autotune").glob("*.json")
    path.write_text('{"best": {"block_m": 1')
    monkeypatch.setattr(autotune, "_memo", {})
    assert autotune.tune("flash_attn", CPU, PROBLEM, TILES, _make_call) == TILES[1]
    assert len(calls) == 6 and json.loads(path.read_text())["best"]["block_m"] == 16


def test_tuning_device_needs_cuda_or_an_injected_timer(monkeypatch):
    monkeypatch.setattr(autotune, "_timer", None)
    assert autotune.tuning_device(CPU) is None
    monkeypatch.setattr(autotune, "_timer", lambda fn: 1.0)
    assert autotune.tuning_device(CPU) == CPU  # the tests run under TRITON_INTERPRET=1
    monkeypatch.setenv("KILN_AUTOTUNE", "0")
    assert autotune.tuning_device(CPU) is None


@pytest.mark.parametrize("capability", [(8, 0), (8, 9), (9, 0)])
@pytest.mark.parametrize("head_dim", [64, 128, 256])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_candidates_are_short_start_with_the_default_and_fit(capability, head_dim, dtype):
    tiles = candidate_tiles(head_dim, dtype, capability)
    assert tiles[0] == default_tile(head_dim, dtype, capability) and len(tiles) == len(set(tiles)) <= 10
    for tile in tiles[1:]:
        tile.validate()
        assert tile.block_m in (64, 128) and tile.block_n in (32, 64, 128) and tile.num_warps in (4, 8)
        assert 2 <= tile.num_stages <= 4
        assert shared_memory_estimate(tile, head_dim, dtype) <= shared_memory_limit(capability)
    if head_dim <= 128 and dtype != torch.float32 and capability != (8, 9):
        assert len(tiles) >= 6  # a real choice on sm80 / sm90 (sm89's 99 KiB leaves fewer)


def test_shared_memory_estimate_matches_sm90_compiles():
    # Measured with triton 3.9 compiling the flash kernel for sm90 (tests/codegen/test_cuda_compile.py).
    assert shared_memory_estimate(TileConfig(128, 64, 8, 3), 128, torch.bfloat16) == 131072
    assert shared_memory_estimate(TileConfig(128, 128, 8, 3), 128, torch.bfloat16) == 229376
    assert shared_memory_estimate(TileConfig(64, 64, 4, 3), 64, torch.float16) == 57344


_DRIVER = """
import sys, time
from kiln.codegen import autotune
from kiln.codegen.cache import cache_stats
def timer(fn):
    start = time.perf_counter()
    fn()
    return (time.perf_counter() - start) * 1e3
autotune.set_timer(timer)
from kiln.cli.commands import main
code = main(["compile", "tiny-llama"])
print(f"renders={cache_stats().renders}")
sys.exit(code)
"""


def test_a_second_process_renders_and_tunes_nothing(tmp_path):
    environ = {**os.environ, "KILN_CACHE_DIR": str(tmp_path), "TRITON_INTERPRET": "1", "KILN_AUTOTUNE": "1"}

    def compile_once() -> tuple[str, str]:
        r = subprocess.run([sys.executable, "-c", _DRIVER], env=environ, cwd=ROOT, capture_output=True, text=True,
                           timeout=300)  # fmt: skip
        assert r.returncode == 0, r.stderr
        return r.stdout, r.stderr

    out1, err1 = compile_once()
    [path] = (tmp_path / "autotune").glob("flash_attn_*.json")
    first = json.loads(path.read_text())
    assert "autotune: 1 tuned (" in err1 and "0 loaded from the cache" in err1
    assert len(first["timings_ms"]) == len(candidate_tiles(first["problem"]["head_dim"], torch.float32, None))
    assert int(out1.split("renders=")[1]) > 0

    out2, err2 = compile_once()
    assert "autotune: 0 tuned (0 configs timed), 1 loaded from the cache" in err2
    assert "0 rendered and compiled" in err2 and int(out2.split("renders=")[1]) == 0
    assert json.loads(path.read_text()) == first  # read, not rewritten


def test_paged_prefill_takes_the_tuned_flash_tile_on_the_gpu_it_was_tuned_on(tuner, monkeypatch):
    """Serving's paged prefill (no tile pinned) reads the flash kernel's tuning cache, never times anything."""
    import kiln.codegen.paged_tiles as paged

    gpu = {"cap": (9, 0), "name": "NVIDIA H100 80GB HBM3"}
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: gpu["cap"])
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: gpu["name"])
    cuda = torch.device("cuda", 0)
    candidates = candidate_tiles(128, torch.bfloat16, (9, 0))
    paged.prefill_tile.cache_clear()
    assert paged.prefill_tile(cuda, torch.bfloat16, 128, True, False) == default_tile(128, torch.bfloat16, (9, 0))
    from kiln import env

    monkeypatch.setattr(env, "flash_tma", lambda: True)  # KILN_FLASH_TMA=1: a TMA-tuned tile is not the paged one's
    problem = paged.flash_problem(torch.bfloat16, 128, True, False, (9, 0))
    assert problem["tma"] is True
    assert not paged.flash_problem(torch.bfloat16, 128, True, False, (8, 0))["tma"]  # no TMA before sm90
    assert not paged.flash_problem(torch.bfloat16, 80, True, False, (9, 0))["tma"]  # a head is not a TMA box
    times = {tile: 1.0 + i for i, tile in enumerate(candidates)}
    times[candidates[0]] = 0.25
    autotune.set_timer(lambda fn: times[fn()])  # the tuner fixture restores the original
    assert autotune.tune("flash_attn", cuda, problem, candidates, _make_call) == candidates[0]
    monkeypatch.setattr(env, "flash_tma", lambda: False)
    problem = paged.flash_problem(torch.bfloat16, 128, True, False, (9, 0))
    assert problem == {"dtype": "bfloat16", "head_dim": 128, "causal": True, "window": False, "tma": False}
    monkeypatch.setattr(autotune, "_memo", {})
    paged.prefill_tile.cache_clear()
    assert paged.prefill_tile(cuda, torch.bfloat16, 128, True, False) == default_tile(128, torch.bfloat16, (9, 0))
    times[candidates[0]] = 2.0
    times[candidates[-1]] = 0.5
    assert autotune.tune("flash_attn", cuda, problem, candidates, _make_call) == candidates[-1]
    monkeypatch.setattr(autotune, "_memo", {})
    paged.prefill_tile.cache_clear()
    assert paged.prefill_tile(cuda, torch.bfloat16, 128, True, False) == candidates[-1]
    assert paged.prefill_tile(cuda, torch.bfloat16, 128, True, True) == default_tile(128, torch.bfloat16, (9, 0))
    gpu["name"] = "NVIDIA A100-SXM4-80GB"  # another GPU (same capability key aside): its own tuning
    paged.prefill_tile.cache_clear()
    assert paged.prefill_tile(cuda, torch.bfloat16, 128, True, False) == default_tile(128, torch.bfloat16, (9, 0))
    paged.prefill_tile.cache_clear()
