"""The rope kernel, plain and with its q/k norm (kiln::qk_norm_rope), compiled for sm90 (H100) and sm80 (A100) on
this machine without a GPU, as tests/codegen/test_cuda_compile.py does for the attention kernels."""

from __future__ import annotations

import pytest

from tests.support.cuda_compile import compile_in_subprocess, ptxas_available

pytestmark = pytest.mark.skipif(not ptxas_available(), reason="triton's CUDA backend (ptxas) is not installed")


def _rope(arch: int, head_dim: int, norm: bool, dtype: str = "bf16", block_h: int = 16) -> dict:
    consts = {"BLOCK_H": block_h, "BLOCK_HALF": head_dim // 2, "NORM": norm}
    dtypes = {"*": f"*{dtype}", "pos_ptr": "*i64", "inv_freq_ptr": "*fp32", "eps": "fp32"}
    return {"template": "rope", "name": "rope_kernel", "op": "qk_norm_rope" if norm else "rope", "consts": consts,
            "options": {"num_warps": 4}, "arch": arch, "dtypes": dtypes,
            "divisible": ["stride_xt", "stride_ot", "HALF"]}  # fmt: skip


def test_rope_kernels_compile_for_h100_and_a100():
    # Qwen3-0.6B's site (16 q heads + 8 k heads of 128: two blocks of 16 heads), Llama's rope, fp16, sm80.
    requests = [_rope(90, 128, True), _rope(90, 128, False), _rope(90, 64, True, "fp16"), _rope(80, 128, True)]
    compile_in_subprocess(requests)  # asserts that each compiled
