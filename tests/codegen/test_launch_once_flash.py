"""Flash attention decides per device or per shape, once, what does not change between launches: whether the
device can load through TMA descriptors (its capability) and a dense batch's sequence offsets (an int32 arange),
with results unchanged. The offsets' cache keeps the OFFSETS_MAX shapes used last (a server sees many prompt
shapes), and never drops one a CUDA graph captured."""

from __future__ import annotations

import sys
from collections import OrderedDict

import torch
from torch._subclasses.fake_tensor import FakeTensorMode

import kiln.codegen.flash_attn as fa
from kiln.codegen.tiles import TileConfig
from kiln.ir import ops

TILE = TileConfig(16, 16, 4, 1)


def _aranges(monkeypatch) -> list[tuple]:
    """The torch.arange calls made from kiln.codegen.flash_attn from now on (the interpreter's own not counted)."""
    made, real = [], torch.arange

    def arange(*args, **kwargs):
        if sys._getframe(1).f_globals.get("__name__") == fa.__name__:
            made.append(args)
        return real(*args, **kwargs)

    monkeypatch.setattr(torch, "arange", arange)
    return made


def _qkv(b: int, t: int, s: int, heads: int = 2, d: int = 16) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(b * 100 + t * 10 + s)
    return tuple(torch.randn(b, n, heads * d, generator=g) for n in (t, s, s))


def _empty_cache(monkeypatch) -> None:
    monkeypatch.setattr(fa, "_OFFSETS", OrderedDict())
    monkeypatch.setattr(fa, "_PINNED", {})


def test_a_dense_batchs_offsets_are_made_once_per_shape_and_give_the_same_result(monkeypatch):
    _empty_cache(monkeypatch)
    made = _aranges(monkeypatch)
    q, k, v = _qkv(3, 5, 5)
    first = fa.flash_attention(q, k, v, 2, 2, True, 0, 0.25, TILE)
    assert made == [(0, 20, 5)]  # self-attention: one offsets tensor for queries and keys
    second = fa.flash_attention(q, k, v, 2, 2, True, 0, 0.25, TILE)
    assert made == [(0, 20, 5)] and torch.equal(first, second)  # the second call made none
    # What the wrapper computed before the cache: offsets built on the call, the same kernel.
    cu = torch.tensor([0, 5, 10, 15], dtype=torch.int32)
    old = fa.flash_attention_varlen(q.reshape(15, -1), k.reshape(15, -1), v.reshape(15, -1), cu, cu, 5, 5, 2, 2,
                                    True, 0, 0.25, TILE).view_as(q)  # fmt: skip
    assert torch.equal(first, old)
    torch.testing.assert_close(first, ops.attention(q, k, v, 2, 2, True, 0, 0.25), rtol=1e-4, atol=1e-5)

    q, k, v = _qkv(3, 5, 9)  # a cached prefix (S > T): the queries' offsets are the ones above
    got = fa.flash_attention(q, k, v, 2, 2, True, 0, 0.25, TILE)
    assert made == [(0, 20, 5), (0, 36, 9)]
    fa.flash_attention(q, k, v, 2, 2, True, 0, 0.25, TILE)
    assert len(made) == 2
    torch.testing.assert_close(got, ops.attention(q, k, v, 2, 2, True, 0, 0.25), rtol=1e-4, atol=1e-5)
    assert set(fa._OFFSETS) == {(torch.device("cpu"), 3, 5), (torch.device("cpu"), 3, 9)}


def test_offsets_made_for_a_dry_run_are_not_kept(monkeypatch):
    """A FakeTensor (lowering's dry run, shape propagation) has no values a later launch could read."""
    _empty_cache(monkeypatch)
    with FakeTensorMode():
        fake = fa._dense_offsets(torch.device("cpu"), 2, 4)
    assert type(fake) is not torch.Tensor and fa._OFFSETS == {}
    real = fa._dense_offsets(torch.device("cpu"), 2, 4)
    assert real.tolist() == [0, 4, 8] and fa._dense_offsets(torch.device("cpu"), 2, 4) is real


CPU = torch.device("cpu")


def test_the_offsets_cache_keeps_the_shapes_used_last_and_stays_bounded(monkeypatch):
    _empty_cache(monkeypatch)
    made = _aranges(monkeypatch)
    first = fa._dense_offsets(CPU, 1, 1)
    for length in range(2, 3 * fa.OFFSETS_MAX):
        assert fa._dense_offsets(CPU, 1, 1) is first  # used on every round: never the least recently used
        got = fa._dense_offsets(CPU, 2, length)
        assert got.tolist() == [0, length, 2 * length] and got.dtype == torch.int32
        assert len(fa._OFFSETS) <= fa.OFFSETS_MAX
    assert len(fa._OFFSETS) == fa.OFFSETS_MAX and len(made) == 3 * fa.OFFSETS_MAX - 1
    assert list(fa._OFFSETS)[-2:] == [(CPU, 1, 1), (CPU, 2, 3 * fa.OFFSETS_MAX - 1)]  # used last, last
    assert (CPU, 2, 2) not in fa._OFFSETS  # the oldest went: asked again, it is made again, with the same values
    assert fa._dense_offsets(CPU, 2, 2).tolist() == [0, 2, 4] and len(made) == 3 * fa.OFFSETS_MAX


def test_attention_is_right_for_a_shape_whose_offsets_were_dropped(monkeypatch):
    _empty_cache(monkeypatch)
    monkeypatch.setattr(fa, "OFFSETS_MAX", 2)
    shapes = [(2, 3, 3), (1, 4, 4), (3, 2, 5), (2, 3, 3)]  # the last one's offsets were dropped in between
    for b, t, s in shapes:
        q, k, v = _qkv(b, t, s)
        got = fa.flash_attention(q, k, v, 2, 2, True, 0, 0.25, TILE)
        torch.testing.assert_close(got, ops.attention(q, k, v, 2, 2, True, 0, 0.25), rtol=1e-4, atol=1e-5)
        assert len(fa._OFFSETS) <= 2


def test_offsets_a_cuda_graph_captured_are_never_dropped(monkeypatch):
    """While a graph is captured a cached tensor is pinned (the graph replays reading its address); one made during
    the capture is not kept (its values are written only on replay)."""
    _empty_cache(monkeypatch)
    monkeypatch.setattr(fa, "OFFSETS_MAX", 2)
    warm = fa._dense_offsets(CPU, 2, 4)  # the warm-up run before capture
    monkeypatch.setattr(fa, "_capturing", lambda device: True)
    assert fa._dense_offsets(CPU, 2, 4) is warm and fa._PINNED == {(CPU, 2, 4): warm}
    during = fa._dense_offsets(CPU, 2, 5)
    assert (CPU, 2, 5) not in fa._OFFSETS and (CPU, 2, 5) not in fa._PINNED
    monkeypatch.setattr(fa, "_capturing", lambda device: False)
    for length in range(6, 20):  # many shapes after the capture: the captured one stays
        fa._dense_offsets(CPU, 2, length)
    assert fa._dense_offsets(CPU, 2, 4) is warm and warm.tolist() == [0, 4, 8] and len(fa._OFFSETS) == 2
    assert fa._dense_offsets(CPU, 2, 5) is not during


def test_the_tma_capability_is_asked_once_per_device(monkeypatch):
    asked = []
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: asked.append(device) or (8, 0))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA A100")
    fa._cuda_tma_blocker.cache_clear()
    try:
        for _ in range(3):
            assert fa._device_tma_blocker(torch.device("cuda", 0)) == "NVIDIA A100 has no TMA (sm90+ only)"
        assert asked == [torch.device("cuda", 0)]
        fa._device_tma_blocker(torch.device("cuda", 1))
        assert asked == [torch.device("cuda", 0), torch.device("cuda", 1)]
    finally:
        fa._cuda_tma_blocker.cache_clear()  # the pretend A100 must not answer for a real device later


def test_tma_on_the_interpreter_matches_pointer_loads_and_follows_the_setting(monkeypatch):
    """tma=True under TRITON_INTERPRET: allowed for the CPU device, and the result is the pointer-load kernel's. The
    interpreter is a setting, not the device's: read on each call, so turning it off refuses TMA on the CPU."""
    q, k, v = _qkv(2, 7, 7)
    plain = fa.flash_attention(q, k, v, 2, 2, True, 0, 0.25, TILE, tma=False)
    first = fa.flash_attention(q, k, v, 2, 2, True, 0, 0.25, TILE, tma=True)
    torch.testing.assert_close(first, plain, rtol=1e-5, atol=1e-6)
    assert fa._device_tma_blocker(torch.device("cpu")) is None
    monkeypatch.setattr(fa.env, "triton_interpret", lambda: False)
    assert fa._device_tma_blocker(torch.device("cpu")) == "q is on cpu"
