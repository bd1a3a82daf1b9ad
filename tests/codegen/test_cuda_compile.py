"""The attention kernels compiled for sm90 (H100) and sm80 (A100) on this machine, without a GPU: triton's own
ptxas builds the cubin, so a kernel that fails to compile, overflows shared memory or is not pipelined shows
here, not in the next GPU session. (Run in a subprocess: the test process has TRITON_INTERPRET=1.)"""

from __future__ import annotations

import pytest
import torch

from kiln.codegen.paged_tiles import decode_candidates
from kiln.codegen.tiles import TileConfig, candidate_tiles, default_tile, shared_memory_limit
from tests.support.cuda_compile import compile_in_subprocess, ptxas_available

pytestmark = pytest.mark.skipif(not ptxas_available(), reason="triton's CUDA backend (ptxas) is not installed")

# Integer arguments a real launch passes as multiples of 16 (triton specializes those): row strides, head dims
# that are multiples of 16 (64, 80, 128), the cache's block and row strides, a block size of 16.
_DIVISIBLE = ["stride_qt", "stride_qh", "stride_kt", "stride_kh", "stride_vt", "stride_vh", "stride_ot", "stride_oh",
              "stride_cb", "stride_co", "stride_ch", "HEAD_DIM", "block_size"]
# DOT_FP32 False, as dot_consts gives a 16-bit launch on a GPU (this process runs under the interpreter, where it
# would say True).
_FLAGS = {"CAUSAL": True, "HAS_WINDOW": False, "EVEN_D": True, "INPUT_PRECISION": None, "DOT_FP32": False}
_DESCS = ("q_desc", "k_desc", "v_desc")


def _flash(arch, d, tile: TileConfig, dtype="bf16", **flags):
    consts = {"BLOCK_M": tile.block_m, "BLOCK_N": tile.block_n, "BLOCK_D": d, **_FLAGS, "USE_TMA": False, **flags}
    dtypes = {"*": f"*{dtype}", "cu_seqlens_q_ptr": "*i32", "cu_seqlens_k_ptr": "*i32"}
    if consts["USE_TMA"]:
        rows = {"q_desc": tile.block_m, "k_desc": tile.block_n, "v_desc": tile.block_n}
        dtypes |= {name: f"tensordesc<{dtype}[{rows[name]},{d}]>" for name in _DESCS}
    return {"template": "flash_attn", "name": "flash_attn_kernel", "op": "attention", "consts": consts,
            "options": tile.options(), "arch": arch, "dtypes": dtypes, "divisible": _DIVISIBLE,
            "none": () if consts["USE_TMA"] else _DESCS}  # fmt: skip


_PAGED_INDEX = {"block_tables_ptr": "*i32", "context_lens_ptr": "*i32", "query_start_loc_ptr": "*i32"}


def _paged_dtypes(dtype, quant):
    cache = "*i8" if quant else f"*{dtype}"
    return {"*": f"*{dtype}", "k_cache_ptr": cache, "v_cache_ptr": cache, "k_scale_ptr": "*fp32",
            "v_scale_ptr": "*fp32", "part_o_ptr": "*fp32", "part_lse_ptr": "*fp32", **_PAGED_INDEX}


def _prefill(arch, d, tile: TileConfig, dtype="bf16", quant=False, even_d=True):
    consts = {"BLOCK_M": tile.block_m, "BLOCK_N": tile.block_n, "BLOCK_D": d, **_FLAGS, "KV_QUANT": quant,
              "EVEN_D": even_d}
    return {"template": "paged_prefill", "name": "paged_prefill_kernel", "op": "paged_attention_prefill",
            "consts": consts, "options": tile.options(), "arch": arch, "dtypes": _paged_dtypes(dtype, quant),
            "divisible": _DIVISIBLE}


_DECODE_DEFAULT = TileConfig(16, 64, 4, 2)


def _decode(arch, d, dtype="bf16", quant=False, window=False, tile=_DECODE_DEFAULT, even_d=True):
    consts = {"BLOCK_G": tile.block_m, "BLOCK_N": tile.block_n, "BLOCK_D": d, "HAS_WINDOW": window, "EVEN_D": even_d,
              "INPUT_PRECISION": None, "DOT_FP32": False, "KV_QUANT": quant}
    return {"template": "paged_decode", "name": "paged_decode_kernel", "op": "paged_attention_decode",
            "consts": consts, "options": tile.options(), "arch": arch,
            "dtypes": _paged_dtypes(dtype, quant), "divisible": _DIVISIBLE}


def test_attention_kernels_compile_pipelined_for_h100_and_a100():
    h100, a100 = (9, 0), (8, 0)
    requests = [
        _flash(90, 128, default_tile(128, torch.bfloat16, h100)),
        _flash(90, 64, default_tile(64, torch.float16, h100), "fp16", HAS_WINDOW=True),
        _flash(80, 128, default_tile(128, torch.bfloat16, a100), CAUSAL=False),
        _flash(90, 128, default_tile(80, torch.bfloat16, h100), EVEN_D=False),  # head dim 80 in a 128 tile
        _flash(90, 128, default_tile(128, torch.bfloat16, h100), USE_TMA=True),  # KILN_FLASH_TMA=1
        _flash(90, 64, default_tile(64, torch.float16, h100), "fp16", USE_TMA=True, HAS_WINDOW=True),
        _prefill(90, 128, default_tile(128, torch.bfloat16, h100)),
        _prefill(90, 128, default_tile(128, torch.float16, h100), "fp16", quant=True),
        _decode(90, 128),
        _decode(90, 64, "fp16", quant=True, window=True),
        _decode(80, 128),
        # head_dim 8 (tiny test checkpoints): the head masked up to a 16-wide tile, tl.dot's smallest K
        _prefill(90, 16, default_tile(8, torch.bfloat16, h100), even_d=False),
        _decode(90, 16, even_d=False),
    ]
    for req, res in zip(requests, compile_in_subprocess(requests), strict=True):
        arch = req["arch"]
        assert res["shared"] <= shared_memory_limit((arch // 10, arch % 10)), (req, res)
        assert res["mma"] > 0, (req, res)  # tensor cores: wgmma on sm90, mma.sync on sm80
        if req["options"]["num_stages"] > 1 and not req["consts"].get("USE_TMA"):
            assert res["cp_async"] > 0, (req, res)  # the K/V loads are pipelined with async copies
        if req["consts"].get("USE_TMA"):
            assert res["tma"] > 0, (req, res)  # bulk tensor copies


def test_every_h100_candidate_tile_compiles_and_fits():
    h100 = (9, 0)
    tiles = candidate_tiles(128, torch.bfloat16, h100)
    decode = decode_candidates(128, 4, torch.bfloat16, h100)
    results = compile_in_subprocess([_flash(90, 128, tile) for tile in tiles]
                                    + [_decode(90, 128, tile=tile) for tile in decode])
    for tile, res in zip(tiles + decode, results, strict=True):
        assert res["shared"] <= shared_memory_limit(h100), (tile, res)
