"""The int8 KV cache: per token and head scales (kiln.ir.ops_paged.quantize_kv), the paged kernels against the
reference op on int8 caches (shuffled blocks, block sizes 1 and 16, GQA 1 and 4, split decode, prefill after a
cached prefix), the int8 reference against the float cache, pool sizing, compile_step and an engine run."""

from __future__ import annotations

import copy

import pytest
import torch

from kiln.build import load_model
from kiln.compile.step import allocate_kv_cache, compile_step
from kiln.errors import CodegenError, KilnError
from kiln.ir.ops_paged import gather_kv, quantize_kv
from kiln.ir.ops_paged import paged_attention as reference
from kiln.runtime.engine import Engine
from kiln.runtime.sampling_params import SamplingParams
from kiln.step import KVCache, kv_bytes_per_block
from tests.support.paged_helper import LAYER, gathered_attention, paged_inputs, shuffled_block_tables, step_batch


def _int8(cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(int8 data, scales, the dequantized fp32 cache) of a float cache."""
    data, scales = quantize_kv(cache)
    return data, scales, data.float() * scales[..., None]


def test_quantize_kv_round_trip_and_zero_rows():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(5, 3, 64, generator=g) * torch.tensor([1e-3, 1.0, 30.0])[None, :, None]
    x[2, 1] = 0
    q, s = quantize_kv(x)
    assert q.dtype == torch.int8 and s.dtype == torch.float32 and s.shape == (5, 3)
    assert q.abs().amax(-1).eq(127).sum() == 14 and not q[2, 1].any() and s[2, 1] == 0
    assert ((q.float() * s[..., None] - x).abs() <= s[..., None] / 2 * (1 + 1e-5)).all()


@pytest.mark.parametrize("block_size,d", [(1, 64), (16, 64), (4, 6)])
def test_write_kernel_quantizes_like_the_reference(block_size, d):
    from kiln.codegen.paged import paged_kv_write
    from kiln.ir.ops_paged import write_kv

    kv_heads, n = 2, 9
    g = torch.Generator().manual_seed(block_size)
    blocks = 24 // block_size + 2
    cache = torch.randint(-127, 128, (2, 2, blocks, block_size, kv_heads, d), generator=g, dtype=torch.int8)
    scales = torch.rand(cache.shape[:-1], generator=g)
    slots = torch.randperm(blocks * block_size, generator=g)[:n]
    slots[4] = -1  # a padding token
    kv = torch.randn(n, 3 * kv_heads * d, generator=g).half()
    k, v = kv[:, : kv_heads * d], kv[:, 2 * kv_heads * d :]
    k[3, :d] = 0  # an all-zero head row: scale 0, values 0
    want, want_scales = cache.clone(), scales.clone()
    write_kv(k, v, want, LAYER, slots, want_scales)
    paged_kv_write(k, v, cache, LAYER, slots, scales)
    assert torch.equal(cache, want) and torch.equal(scales, want_scales)
    with pytest.raises(CodegenError, match="needs kv_scales"):
        paged_kv_write(k, v, cache, LAYER, slots)


# (heads, kv_heads, head_dim, block_size, context lengths, num_splits)
DECODE = {
    "bs16-gqa4-3splits": (4, 1, 64, 16, [70, 17, 5], 3),
    "bs1-gqa1-2splits": (2, 2, 64, 1, [45, 9], 2),
    "bs4-d8-gqa2": (4, 2, 8, 4, [23, 6], 2),
}


@pytest.mark.parametrize("case", list(DECODE))
def test_decode_on_int8_cache_matches_reference(case):
    from kiln.codegen.paged import paged_attention_decode

    heads, kv_heads, d, bs, ctx, splits = DECODE[case]
    q, cache, tables, bt, cl, qsl = paged_inputs(heads, kv_heads, d, bs, [1] * len(ctx), ctx, seed=len(case))
    data, scales, deq = _int8(cache)
    out = torch.full_like(q, float("nan"))
    got = paged_attention_decode(q, data, LAYER, bt, cl, qsl, max(ctx), heads, 0, d**-0.5, num_splits=splits,
                                 out=out, kv_scales=scales)  # fmt: skip
    want = gathered_attention(q, deq, tables, [1] * len(ctx), ctx, heads, kv_heads, True, 0, d**-0.5)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("bs,kv_heads", [(16, 1), (1, 4)], ids=["bs16-gqa4", "bs1-gqa1"])
def test_prefill_after_cached_prefix_on_int8_cache_matches_reference(bs, kv_heads):
    from kiln.codegen.paged import paged_attention_prefill
    from kiln.codegen.tiles import TileConfig

    heads, d, q_lens, ctx = 4, 64, [7, 3, 1], [7, 20, 9]
    q, cache, tables, bt, cl, qsl = paged_inputs(heads, kv_heads, d, bs, q_lens, ctx, seed=bs + kv_heads)
    data, scales, deq = _int8(cache)
    out = torch.full_like(q, float("nan"))
    got = paged_attention_prefill(q, data, LAYER, bt, cl, qsl, max(q_lens), heads, True, 0, d**-0.5,
                                  TileConfig(16, 16, 4, 1), out=out, kv_scales=scales)  # fmt: skip
    want = gathered_attention(q, deq, tables, q_lens, ctx, heads, kv_heads, True, 0, d**-0.5)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)


def _op_case(q_lens, dtype):
    heads, kv_heads, d, bs, ctx = 4, 2, 64, 16, [21, 35]
    q, cache, tables, bt, cl, qsl = paged_inputs(heads, kv_heads, d, bs, q_lens, ctx, seed=sum(q_lens), dtype=dtype)
    g = torch.Generator().manual_seed(5)
    k = torch.randn(1, sum(q_lens), kv_heads * d, generator=g).to(dtype)
    v = torch.randn(1, sum(q_lens), kv_heads * d, generator=g).to(dtype)
    rows = [(t, p) for t, ql, c in zip(tables, q_lens, ctx, strict=True) for p in range(c - ql, c)]
    slots = torch.tensor([t[p // bs] * bs + p % bs for t, p in rows])
    args = (LAYER, slots, bt, cl, qsl, max(q_lens), max(ctx), heads, kv_heads, True, 0, d**-0.5)
    return q[None], k, v, cache, args


@pytest.mark.parametrize("q_lens", [[1, 1], [4, 1]], ids=["decode", "mixed"])
def test_paged_attention_op_kernels_on_int8_cache(q_lens):
    from kiln.codegen.paged import paged_attention

    q, k, v, cache, args = _op_case(q_lens, torch.float32)
    data, scales, _ = _int8(cache)
    want_data, want_scales = data.clone(), scales.clone()
    want = reference(q, k, v, want_data, *args, want_scales)
    got = paged_attention(q, k, v, data, *args, scales, out=torch.full_like(q, float("nan")))
    assert torch.equal(data, want_data) and torch.equal(scales, want_scales)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)


def test_int8_reference_is_close_to_the_float_cache():
    q, k, v, cache, args = _op_case([4, 1], torch.float32)
    data, scales, _ = _int8(cache)
    want = reference(q, k, v, cache.clone(), *args, None)
    got = reference(q, k, v, data, *args, scales)
    assert ((got - want).norm() / want.norm()).item() < 2e-2
    keys, _ = gather_kv(data, LAYER, args[2][0], 21, scales)
    assert keys.dtype == torch.float32 and keys.shape == (1, 21, 2 * 64)


def test_kv_bytes_per_block_int8_is_about_half_of_bf16():
    class Model:
        num_layers, num_kv_heads, head_dim = 16, 8, 64
        dtype = torch.bfloat16

    bf16, int8 = Model(), Model()
    bf16.kv_dtype, int8.kv_dtype = torch.bfloat16, torch.int8
    assert kv_bytes_per_block(bf16, 16) == 16 * 2 * 16 * 8 * 64 * 2
    assert kv_bytes_per_block(int8, 16) == 16 * 2 * 16 * 8 * (64 + 4)  # values plus one fp32 scale per row
    assert 0.5 < kv_bytes_per_block(int8, 16) / kv_bytes_per_block(bf16, 16) < 0.55


@pytest.fixture(scope="module")
def tiny():
    m = load_model("tiny-llama", device="cpu", seed=0)
    return m, {kv: compile_step(copy.deepcopy(m.gm), m.model, m.compile, use_kernels=False, kv_cache_dtype=kv)
               for kv in ("auto", "int8")}


def test_compile_step_int8_with_kernels_matches_reference_ops(tiny):
    m, models = tiny
    ref = models["int8"]
    assert ref.kv_dtype == torch.int8 and ref.dtype == torch.float32 and ref.block_size == 16
    kern = compile_step(copy.deepcopy(load_model("tiny-llama", device="cpu", seed=0).gm), m.model, m.compile,
                        use_kernels=True, kv_cache_dtype="int8")  # fmt: skip
    seqs = [list(range(3, 15)), list(range(40, 50))]
    tables, num_blocks = shuffled_block_tables([12, 10], 4, seed=3)
    caches = [allocate_kv_cache(x, num_blocks, 4) for x in (kern, ref)]
    assert caches[0].data.dtype == torch.int8 and caches[0].scales.shape == caches[0].data.shape[:-1]
    for chunks in ([(0, 7), (0, 9)], [(7, 11), (9, 10)], [(11, 12), None]):  # prefill, chunk + decode, decode
        live = [i for i, c in enumerate(chunks) if c is not None]
        batch = step_batch([seqs[i] for i in live], [chunks[i] for i in live], [tables[i] for i in live], 4)
        got, want = kern(batch, caches[0]), ref(batch, caches[1])
        torch.testing.assert_close(got, want, rtol=1e-4, atol=2e-5)
        # K/V themselves differ by float rounding between the paths (norm, rope kernels): codes by at most one.
        assert (caches[0].data.int() - caches[1].data.int()).abs().max() <= 1
        torch.testing.assert_close(caches[0].scales, caches[1].scales, rtol=1e-5, atol=0)
    with pytest.raises(KilnError, match="with fp32 scales"):
        ref(batch, KVCache(caches[1].data))


def test_engine_with_int8_cache_agrees_with_float_cache(tiny):
    """Greedy runs through the engine, then teacher-forced: random weights leave near-ties (top-2 logit gaps of
    ~2e-3), so one flipped token makes free-running sequences drift apart; scoring the float run's sequences
    with both caches measures the cache's error itself."""
    m, models = tiny
    prompts = [[(7 * i + 3 * j) % 512 for j in range(5 + 9 * i)] for i in range(4)]
    params = SamplingParams(temperature=0, ignore_eos=True, max_tokens=16)
    tokens = {}
    for kv, model in models.items():
        engine = Engine(model, m.tokenizer, m.model, max_num_seqs=4)
        assert engine.block_manager.block_size == 16 and engine.runner.kv_cache.data.dtype == model.kv_dtype
        ids = [engine.add_request(prompt_token_ids=p, params=params) for p in prompts]
        done = {o.request_id: o.outputs[0].token_ids for o in engine.run()}
        tokens[kv] = [done[i] for i in ids]
    assert all(len(t) == 16 for t in tokens["int8"])
    assert [t[0] for t in tokens["int8"]] == [t[0] for t in tokens["auto"]]  # the prefill step's logits
    seqs = [p + t for p, t in zip(prompts, tokens["auto"], strict=True)]
    tables = [list(range(1 + 3 * i, 4 + 3 * i)) for i in range(len(seqs))]
    rows = [r for i, s in enumerate(seqs) for r in range(sum(map(len, seqs[:i])) + len(prompts[i]) - 1,
                                                          sum(map(len, seqs[: i + 1])) - 1)]  # fmt: skip
    batch = step_batch(seqs, [(0, len(s)) for s in seqs], tables, 16, sample_indices=rows)
    fp, q8 = (x(batch, allocate_kv_cache(x, 1 + 3 * len(seqs), 16)) for x in (models["auto"], models["int8"]))
    assert ((q8 - fp).norm(dim=-1) / fp.norm(dim=-1)).max().item() < 3e-2
    want = torch.tensor([t for t in tokens["auto"] for t in t])  # row j of a sequence predicts its token j
    assert (q8.argmax(-1) == want).float().mean().item() >= 0.9
    assert torch.equal(fp.argmax(-1), want)  # the float cache reproduces its own greedy run


@pytest.mark.gpu
@pytest.mark.parametrize("q_lens", [[1] * 24, [300, 1, 64, 1]], ids=["decode-24", "mixed-prefill"])
def test_int8_paged_attention_real_size_on_gpu(q_lens):
    """Llama-8B-like heads at real lengths, bf16 activations over an int8 cache (not run without CUDA)."""
    from kiln.codegen.paged import paged_attention

    heads, kv_heads, d, bs = 32, 8, 128, 16
    g = torch.Generator().manual_seed(len(q_lens))
    ctx = [int(q) + int(torch.randint(0, 1500, (1,), generator=g)) for q in q_lens]
    q, cache, tables, bt, cl, qsl = paged_inputs(heads, kv_heads, d, bs, q_lens, ctx, seed=len(q_lens))
    data, scales, _ = _int8(cache)
    q, data, scales, bt, cl, qsl = (t.cuda() for t in (q.bfloat16(), data, scales, bt, cl, qsl))
    k = torch.randn(1, sum(q_lens), kv_heads * d, device="cuda", dtype=torch.bfloat16)
    v = torch.randn_like(k)
    rows = [(t, p) for t, ql, c in zip(tables, q_lens, ctx, strict=True) for p in range(c - ql, c)]
    slots = torch.tensor([t[p // bs] * bs + p % bs for t, p in rows], device="cuda")
    args = (LAYER, slots, bt, cl, qsl, max(q_lens), max(ctx), heads, kv_heads, True, 0, d**-0.5)
    want_data, want_scales = data.clone(), scales.clone()
    want = reference(q[None].float(), k.float(), v.float(), want_data, *args, want_scales)
    got = paged_attention(q[None], k, v, data, *args, scales, out=torch.full_like(q[None], float("nan")))
    assert (data.int() - want_data.int()).abs().max().item() <= 1  # bf16 k/v rounded the same; fp fusion off
    torch.testing.assert_close(scales, want_scales, rtol=1e-6, atol=0)
    assert not got.isnan().any()
    assert (got.float() - want).abs().max().item() <= 2e-2 * max(want.abs().max().item(), 1.0)
