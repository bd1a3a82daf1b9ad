"""GPU suite (marker `gpu`, skipped without CUDA): every generated kernel at real sizes in bf16 and fp16
against kiln's reference ops, and a compiled model against the uncached reference path.

Run on a GPU machine with `python -m pytest -m gpu -q` (see ../shared/GPU.md). The reference ops compute in
fp32 from the same 16-bit inputs, so the tolerances are a few 16-bit ulps of the output scale.
"""

from __future__ import annotations

import pytest
import torch

from kiln.ir import ops

pytestmark = pytest.mark.gpu

DTYPES = [torch.bfloat16, torch.float16]
TOL = {torch.bfloat16: 2e-2, torch.float16: 2e-3}


def _close(got: torch.Tensor, ref: torch.Tensor, dtype: torch.dtype) -> None:
    assert not torch.isnan(got).any(), "the kernel left NaN (unwritten) elements"
    scale = ref.float().abs().max().item()
    err = (got.float() - ref.float()).abs().max().item()
    assert err <= TOL[dtype] * max(scale, 1.0), f"max abs error {err:.3e} vs scale {scale:.3e}"


def _poison(like: torch.Tensor) -> torch.Tensor:
    return torch.full_like(like, float("nan"))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("kind", ["rms_norm", "layer_norm"])
def test_norm_real_size(kind, dtype):
    from kiln.codegen.norm import layer_norm, rms_norm

    torch.manual_seed(0)
    x = torch.randn(4, 2048, 4096, device="cuda", dtype=dtype)
    r = torch.randn_like(x)
    w = torch.randn(4096, device="cuda", dtype=dtype)
    b = torch.randn(4096, device="cuda", dtype=dtype)
    out, r_out = _poison(x), _poison(x)
    if kind == "rms_norm":
        got, summed = rms_norm(x, w, 1e-5, r, out=out, residual_out=r_out)
        ref = ops.rms_norm(x + r, w, 1e-5)
    else:
        got, summed = layer_norm(x, w, b, 1e-5, r, out=out, residual_out=r_out)
        ref = ops.layer_norm(x + r, w, b, 1e-5)
    _close(summed, x + r, dtype)
    _close(got, ref, dtype)


@pytest.mark.parametrize("dtype", DTYPES)
def test_rope_real_size(dtype):
    from kiln.codegen.rope import rope
    from kiln.ir.frontend import rope_inv_freq
    from kiln.spec.loader import load_spec

    cfg = load_spec("llama-3.1-8b").model  # llama3 scaling folded into inv_freq
    inv_freq = rope_inv_freq(cfg).cuda()
    torch.manual_seed(1)
    x = torch.randn(2, 2048, 32 * 128, device="cuda", dtype=dtype)
    positions = torch.arange(2048, device="cuda").expand(2, 2048).contiguous() + 100_000
    got = rope(x, positions, inv_freq, out=_poison(x))
    _close(got, ops.rope(x, positions, inv_freq), dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("kind", ["silu", "gelu", "gelu_tanh"])
def test_gated_act_real_size(kind, dtype):
    from kiln.codegen.act import gated_act

    torch.manual_seed(2)
    gate = torch.randn(4096, 14336, device="cuda", dtype=dtype)
    up = torch.randn_like(gate)
    _close(gated_act(gate, up, kind, out=_poison(gate)), ops.gated_act(gate, up, kind), dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(
    ("seq", "heads", "kv_heads", "head_dim", "causal", "window"),
    [
        (1024, 32, 8, 128, True, 0),
        (2048, 32, 8, 128, True, 0),
        (2048, 32, 8, 128, True, 512),
        (1024, 14, 2, 64, True, 0),
        (1000, 16, 16, 80, False, 0),
        (777, 8, 1, 256, True, 0),
    ],
)
def test_flash_attention_real_size(dtype, seq, heads, kv_heads, head_dim, causal, window):
    from kiln.codegen.flash_attn import flash_attention

    torch.manual_seed(3)
    q = torch.randn(2, seq, heads * head_dim, device="cuda", dtype=dtype)
    k = torch.randn(2, seq, kv_heads * head_dim, device="cuda", dtype=dtype)
    v = torch.randn_like(k)
    scale = head_dim**-0.5
    got = flash_attention(q, k, v, heads, kv_heads, causal, window, scale, out=_poison(q))
    _close(got, ops.attention(q, k, v, heads, kv_heads, causal, window, scale), dtype)


@pytest.mark.parametrize("dtype", DTYPES)
def test_flash_attention_varlen_real_size(dtype):
    from kiln.codegen.flash_attn import flash_attention_varlen

    torch.manual_seed(4)
    lens = [1, 300, 1024, 77]
    heads, kv_heads, d = 32, 8, 128
    total = sum(lens)
    q = torch.randn(total, heads * d, device="cuda", dtype=dtype)
    k = torch.randn(total, kv_heads * d, device="cuda", dtype=dtype)
    v = torch.randn_like(k)
    cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], device="cuda", dtype=torch.int32)
    got = flash_attention_varlen(q, k, v, cu, cu, max(lens), max(lens), heads, kv_heads, True, 0, d**-0.5,
                                 out=_poison(q))
    for a, b in zip(cu[:-1].tolist(), cu[1:].tolist(), strict=True):
        ref = ops.attention(q[None, a:b], k[None, a:b], v[None, a:b], heads, kv_heads, True, 0, d**-0.5)[0]
        _close(got[a:b], ref, dtype)


@pytest.mark.parametrize("spec", ["tiny-llama", "tiny-mistral", "tiny-qwen2", "tiny-gpt2"])
def test_compiled_model_matches_reference_on_gpu(spec):
    from kiln.compile.driver import compile_model
    from kiln.ir.frontend import build_graph
    from kiln.reference import forward_logits, generate
    from kiln.runtime.sampling_params import SamplingParams
    from kiln.spec.loader import load_spec

    loaded = load_spec(spec)
    ref_gm = build_graph(loaded.model, device="cuda", seed=0)
    compiled = compile_model(build_graph(loaded.model, device="cuda", seed=0), loaded.compile)
    assert compiled.use_kernels and compiled.kernels
    ids = torch.randint(3, loaded.model.vocab, (2, 37), generator=torch.Generator().manual_seed(5))
    want, got = forward_logits(ref_gm, ids), forward_logits(compiled.gm, ids)
    assert (got - want).abs().max().item() < 1e-4 * want.abs().max().item()
    params = SamplingParams(temperature=0, max_tokens=16)
    prompt = ids[0, :9].tolist()
    ctx = loaded.model.context
    assert generate(compiled.gm, prompt, params, context=ctx).token_ids == generate(
        ref_gm, prompt, params, context=ctx
    ).token_ids
