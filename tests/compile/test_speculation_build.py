"""kiln.speculation: the self drafter's step model (the target cut to L layers, compiled by the target's path) equals a
dense L-layer model's, reads the first L layers of the target's KV cache, and shares the target's weights; a draft
model is loaded in the target's dtype with its tokenizer checked; which config wins (argument, flag, spec key)."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch

from kiln.build import load_model
from kiln.compile.step import allocate_kv_cache, compile_step
from kiln.errors import KilnError, SpecError, UsageError
from kiln.ir.frontend import build_graph
from kiln.model_config import SpeculationConfig, param_shapes
from kiln.spec.loader import load_spec
from kiln.speculation import (
    check_same_tokenizer,
    compile_draft,
    prepare_drafter,
    resolve_speculation,
)
from kiln.step import KVCache
from kiln.tokenizer import HFTokenizer
from tests.support.paged_helper import shuffled_block_tables, step_batch

S = SpeculationConfig
BLOCK = 4
LENS = [7, 12]


def spec_file(tmp_path: Path, *, layers: int = 3, name: str = "target", vocab: int = 512, compile_lines=()) -> Path:
    text = Path(load_spec("tiny-llama").path).read_text()
    text = text.replace("layers = 2", f"layers = {layers}").replace('"tiny-llama"', f'"{name}"')
    text = text.replace("vocab = 512", f"vocab = {vocab}")
    text = text.replace("  dtype = fp32\n", "  dtype = fp32\n" + "".join(f"  {line}\n" for line in compile_lines))
    path = tmp_path / f"{name}.kiln"
    path.write_text(text)
    return path


def dense(loaded_path: Path, layers: int, seed: int = 0, **compile_kw):
    """The reference: the model built with `layers` layers and the full model's weights for them, compiled alone."""
    full = load_model(loaded_path, device="cpu", seed=seed)
    small = dataclasses.replace(full.model, layers=layers)
    weights = {n: full.gm.get_parameter(n).detach().clone() for n in param_shapes(small)}
    return compile_step(build_graph(small, weights), small, full.compile, device="cpu", **compile_kw)


def _batches(seqs, tables):
    """A prefill of every sequence but its last token, then one decode step."""
    yield step_batch(seqs, [(0, n - 1) for n in LENS], tables, BLOCK)
    yield step_batch(seqs, [(n - 1, n) for n in LENS], tables, BLOCK)


def _seqs(vocab: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(11)
    return [torch.randint(0, vocab, (n,), generator=g).tolist() for n in LENS]


@pytest.mark.parametrize("kernels", [False, True], ids=["reference ops", "kernels"])
def test_self_drafter_equals_a_dense_L_layer_model_and_shares_the_target(tmp_path, kernels):
    path = spec_file(tmp_path, compile_lines=["speculation = self(layers = 2, k = 3)"])
    m = load_model(path, device="cpu")
    cfg = resolve_speculation(None, m)
    assert cfg == S("self", k=3, layers=2)
    plan = prepare_drafter(cfg, m)
    target = compile_step(m.gm, m.model, m.compile, device="cpu", use_kernels=kernels)
    draft = compile_draft(plan, target)
    assert compile_draft(plan, target) is draft  # compiled once per plan
    assert (draft.num_layers, draft.use_kernels, draft.passes) == (2, kernels, target.passes)
    assert (draft.kv_dtype, draft.num_kv_heads, draft.head_dim) == (target.kv_dtype, target.num_kv_heads,
                                                                   target.head_dim)
    ref = dense(path, 2, use_kernels=kernels)
    theirs = {id(t) for t in [*target.gm.parameters(), *target.gm.buffers()]}
    assert all(id(t) in theirs for t in [*draft.gm.parameters(), *draft.gm.buffers()])  # no weight held twice

    seqs = _seqs(m.model.vocab)
    tables, num_blocks = shuffled_block_tables(LENS, BLOCK, seed=3)
    cache_t = allocate_kv_cache(target, num_blocks, BLOCK)
    cache_r = allocate_kv_cache(ref, num_blocks, BLOCK)
    prefill, decode = _batches(seqs, tables)
    target(prefill, cache_t)  # the target writes the prompt's K/V for all three layers
    ref(prefill, cache_r)
    # The self drafter reads (and writes) layers [0, 2) of the target's own cache.
    shared = KVCache(cache_t.data[:2], None)
    got = draft(decode, shared)
    want = ref(decode, cache_r)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=2e-5)
    torch.testing.assert_close(cache_t.data[:2], cache_r.data, rtol=1e-4, atol=1e-5)


def test_self_drafter_keeps_an_int8_cache_and_the_block_size(tmp_path):
    path = spec_file(tmp_path, compile_lines=["kv_cache = paged(block = 8, dtype = int8)"])
    m = load_model(path, device="cpu")
    plan = prepare_drafter(resolve_speculation("self(layers = 1)", m), m)
    target = compile_step(m.gm, m.model, m.compile, device="cpu", use_kernels=False)
    draft = compile_draft(plan, target)
    assert (draft.kv_dtype, draft.block_size, draft.num_layers) == (torch.int8, 8, 1)
    assert target.kv_dtype == torch.int8


def test_draft_model_loads_in_the_targets_dtype_and_computes_its_own_logits(tmp_path):
    target_path = spec_file(tmp_path)
    draft_path = spec_file(tmp_path, layers=1, name="small")
    m = load_model(target_path, device="cpu", dtype="bf16")
    cfg = resolve_speculation({"kind": "draft", "spec": str(draft_path), "k": 2}, m)
    plan = prepare_drafter(cfg, m, seed=5)
    assert plan.draft is not None and plan.draft.compile.dtype == "bf16" and plan.model.name == "small"
    target = compile_step(m.gm, m.model, m.compile, device="cpu", use_kernels=False)
    draft = compile_draft(plan, target)
    assert (draft.dtype, draft.num_layers, draft.vocab) == (torch.bfloat16, 1, 512)
    alone = load_model(draft_path, device="cpu", dtype="bf16", seed=5)
    ref = compile_step(alone.gm, alone.model, alone.compile, device="cpu", use_kernels=False)
    seqs = _seqs(512)
    tables, num_blocks = shuffled_block_tables(LENS, BLOCK, seed=4)
    cache_d, cache_r = allocate_kv_cache(draft, num_blocks, BLOCK), allocate_kv_cache(ref, num_blocks, BLOCK)
    for batch in _batches(seqs, tables):
        torch.testing.assert_close(draft(batch, cache_d), ref(batch, cache_r), rtol=0, atol=0)


def test_a_draft_with_another_vocabulary_size_is_refused_at_load(tmp_path):
    m = load_model(spec_file(tmp_path), device="cpu")
    other = spec_file(tmp_path, layers=1, name="wide", vocab=600)
    with pytest.raises(KilnError) as info:
        prepare_drafter(S("draft", spec=str(other)), m)
    msg = str(info.value)
    assert "the draft model 'wide'" in msg and "the target 'target'" in msg
    assert "600 ids in the draft's, 512 in the target's" in msg and "same family" in msg


def test_a_missing_draft_model_names_the_setting(tmp_path):
    m = load_model(spec_file(tmp_path), device="cpu")
    missing = tmp_path / "nowhere.kiln"
    with pytest.raises(UsageError) as info:
        prepare_drafter(S("draft", spec=str(missing)), m)
    assert str(info.value).startswith(f'speculation draft(spec = "{missing}", k = 4): cannot load the draft model: '
                                      f"{missing}: no such spec file")


def _hf_tokenizer(path: Path, words: list[str]) -> HFTokenizer:
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel

    tok = Tokenizer(WordLevel({w: i for i, w in enumerate(words)}, unk_token=words[0]))
    tok.save(str(path))
    return HFTokenizer(path)


def test_tokenizers_must_agree_token_by_token(tmp_path):
    base = load_model(spec_file(tmp_path), device="cpu")
    words = ["<unk>", "a", "b", "c"] + [f"w{i}" for i in range(508)]
    target = dataclasses.replace(base, tokenizer=_hf_tokenizer(tmp_path / "t.json", words), source="target-dir")
    same = dataclasses.replace(base, tokenizer=_hf_tokenizer(tmp_path / "s.json", words), source="same-dir")
    check_same_tokenizer(target, same)
    swapped = words[:2] + ["c", "b"] + words[4:]
    other = dataclasses.replace(base, model=dataclasses.replace(base.model, name="other"),
                                tokenizer=_hf_tokenizer(tmp_path / "o.json", swapped), source="other-dir")
    with pytest.raises(KilnError) as info:
        check_same_tokenizer(target, other)
    msg = str(info.value)
    assert "the draft model 'other' (other-dir) and the target 'target' (target-dir)" in msg
    assert "token 2 is 'c' in the draft's vocabulary (512 tokens, HFTokenizer) and 'b' in the target's" in msg
    with pytest.raises(KilnError, match=r"token 0 is '<0x00>' in the draft's vocabulary \(512 tokens, ByteTokenizer\)"):
        check_same_tokenizer(target, base)  # the byte-level fallback is a tokenizer of its own


def test_which_speculation_wins(tmp_path):
    path = spec_file(tmp_path, compile_lines=["speculation = ngram(n = 2, k = 3)"])
    m = load_model(path, device="cpu")
    assert resolve_speculation(None, m) == S("ngram", k=3, n=2)  # the spec's key
    assert resolve_speculation("off", m) is None  # the flag / argument turns it off
    assert resolve_speculation(S("self", layers=1), m) == S("self", layers=1)
    with pytest.raises(UsageError, match=r"self\(layers = 3, k = 4\): the self drafter must use fewer layers"):
        resolve_speculation("self(layers = 3)", m, "--speculation")
    with pytest.raises(SpecError, match=r"--speculation:1:11: error: n must be a positive integer"):
        resolve_speculation("ngram(n = 0)", m, "--speculation")
    assert prepare_drafter(S("ngram"), m).step is None


def test_build_drafter_makes_the_runtime_drafters(tmp_path):
    speculative = pytest.importorskip("kiln.runtime.speculative", reason="the speculative runtime is merged separately")
    from kiln.speculation import build_drafter

    m = load_model(spec_file(tmp_path), device="cpu")
    plans = [prepare_drafter(S("ngram", k=2, n=4), m), prepare_drafter(S("self", k=3, layers=1), m)]
    target = compile_step(m.gm, m.model, m.compile, device="cpu", use_kernels=False)
    ngram, self_drafter = (build_drafter(p, target) for p in plans)
    assert isinstance(ngram, speculative.NgramDrafter) and isinstance(self_drafter, speculative.ModelDrafter)
    assert build_drafter(plans[1], target) is not self_drafter  # one drafter per engine, one compiled step per plan
