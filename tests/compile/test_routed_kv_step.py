"""compile_step on Mixture-of-Depths models: the step graph over the routed KV cache (passes/kv_cache.py).

Three steps by hand (a prefill of two sequences, a chunk of one and a decode of the other, then two decodes, where
a routed layer that skips a sequence's token gives that sequence no query row; block size 4 so the routed tables
span blocks) on the reference ops and on the generated kernels (Triton's interpreter without a
GPU): the sampled logits equal the uncached reference's, the routed counts the step returns equal the
reference's routing decisions, and each routed layer's pool holds exactly that many written K/V entries.
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch import fx

from kiln.build import load_model
from kiln.compile.step import allocate_kv_cache, compile_step
from kiln.errors import KilnError, PassError
from kiln.ir.frontend import build_graph
from kiln.ir.registry import op_name
from kiln.model_config import CompileConfig
from kiln.spec.loader import load_spec
from kiln.step import StepBatch, step_input_names

SPECS = ("tiny-llama-mod", "tiny-mistral-mod")
BS = 4
# An overflow (a RuntimeWarning of numpy under Triton's interpreter) means some op computed on memory nothing wrote,
# as the body did on a routed layer's padding rows before the paged kernels zeroed their attention output.
pytestmark = pytest.mark.filterwarnings("error::RuntimeWarning")


def _routed(gm: fx.GraphModule, tokens: list[int]) -> torch.Tensor:
    """bool [routed layers, T]: the reference's routing decisions (kiln::mod_threshold_mask's output per layer),
    checked to be clear of the threshold (rounding in a batched step cannot flip them)."""
    masks = []

    class Keep(fx.Interpreter):
        def run_node(self, n):
            out = super().run_node(n)
            if n.target is torch.ops.kiln.mod_threshold_mask.default:
                score, threshold = self.map_nodes_to_values(n.args, n)
                gap = (score - (threshold if threshold is not None else 0.0)).abs().min()
                assert gap > 1e-4, f"a router score lies within {float(gap):.2e} of its threshold: pick another seed"
                masks.append(out[0])
            return out

    with torch.inference_mode():
        Keep(gm).run(torch.tensor([tokens]), torch.arange(len(tokens))[None])
    return torch.stack(masks)


def _batch(chunks, tables, routed_lens, routed_tables) -> StepBatch:
    """chunks: (tokens of the sequence so far, start, end) per sequence, every last row sampled."""
    tok, pos, slot, qsl = [], [], [], [0]
    for (ids, a, b), table in zip(chunks, tables, strict=True):
        tok += ids[a:b]
        pos += list(range(a, b))
        slot += [table[p // BS] * BS + p % BS for p in range(a, b)]
        qsl.append(qsl[-1] + b - a)
    i32 = dict(dtype=torch.int32)
    return StepBatch(
        torch.tensor(tok), torch.tensor(pos), torch.tensor(slot), torch.tensor(tables, **i32),
        torch.tensor([b for _, _, b in chunks], **i32), torch.tensor(qsl, **i32), torch.tensor(qsl[1:]) - 1,
        max(b - a for _, a, b in chunks), max(b for _, _, b in chunks), torch.tensor(routed_lens, **i32),
        torch.tensor(routed_tables, **i32),
    )  # fmt: skip


@pytest.fixture(scope="module", params=SPECS)
def loaded(request):
    return load_model(request.param, device="cpu", seed=4)


@pytest.mark.parametrize("use_kernels", [False, True], ids=["reference", "kernels"])
def test_three_steps_equal_the_reference_and_write_only_routed_tokens(loaded, use_kernels):
    ref = copy.deepcopy(loaded.gm)
    step = compile_step(copy.deepcopy(loaded.gm), loaded.model, loaded.compile, device="cpu", use_kernels=use_kernels)
    assert (step.num_layers, step.num_routed_layers, step.routed_capacity) == (2, 2, 0.5)
    g = torch.Generator().manual_seed(3)
    seqs = [torch.randint(0, 512, (12,), generator=g).tolist(), torch.randint(0, 512, (8,), generator=g).tolist()]
    cache = allocate_kv_cache(step, 9, BS, routed_num_blocks=9)
    tables = [[1, 2, 3], [4, 5, 0]]
    routed_tables = [[[1, 2, 3], [4, 5, 0]], [[6, 7, 8], [3, 2, 0]]]  # per layer; worst case: every token routed
    lens = [[0, 0], [0, 0]]
    for chunks in ([(seqs[0], 0, 7), (seqs[1], 0, 6)], [(seqs[0], 7, 11), (seqs[1], 6, 7)],
                   [(seqs[0], 11, 12), (seqs[1], 7, 8)]):
        logits, routed = step(_batch(chunks, tables, lens, routed_tables), cache)
        assert routed.shape == (2, sum(b - a for _, a, b in chunks))
        starts = [0, *torch.tensor([b - a for _, a, b in chunks]).cumsum(0).tolist()]
        counts = torch.stack([routed[:, s:e].sum(-1) for s, e in zip(starts, starts[1:], strict=False)], 1)
        for i, (ids, a, b) in enumerate(chunks):
            assert routed[:, starts[i]:starts[i + 1]].bool().tolist() == _routed(ref, ids[:b])[:, a:].tolist()
            with torch.inference_mode():
                want = ref(torch.tensor([ids[:b]]), torch.arange(b)[None])[0, -1]
            torch.testing.assert_close(logits[i], want, atol=2e-4, rtol=2e-4)
            assert counts[:, i].tolist() == _routed(ref, ids[:b])[:, a:].sum(-1).tolist()
        lens = [[lens[j][i] + int(counts[j, i]) for i in range(2)] for j in range(2)]
    assert set(counts.flatten().tolist()) == {0, 1}  # the last step: decodes with and without a routed row
    assert lens == [[int(_routed(ref, s)[j].sum()) for s in seqs] for j in range(2)]
    assert 0 < sum(map(sum, lens)) < 2 * (12 + 8)  # some tokens routed, some skipped
    written = (cache.routed[:, 0].abs().sum((-1, -2)) != 0).sum((-1, -2))  # K entries per routed layer
    assert written.tolist() == [sum(row) for row in lens]


def test_the_step_graph_has_a_routed_cache_and_one_slot_op_per_routed_layer():
    spec = load_spec("tiny-mistral-mod")
    step = compile_step(build_graph(spec.model, seed=0), spec.model, spec.compile, use_kernels=False)
    gm = step.gm
    names = [n.name for n in gm.graph.nodes if n.op == "placeholder"]
    assert tuple(names) == step_input_names(False, routed=True)
    slots = [n for n in gm.graph.nodes if op_name(n) == "kiln.mod_kv_slots.default"]
    paged = [n for n in gm.graph.nodes if op_name(n) == "kiln.paged_attention.default"]
    assert [n.args[6] for n in slots] == [0, 1]
    assert [(n.args[3].name, n.args[4]) for n in paged] == [("kv_cache", 0), ("routed_kv_cache", 0),
                                                            ("kv_cache", 1), ("routed_kv_cache", 1)]
    assert all(n.args[14] == 8 for n in paged)  # the window stays per layer (it counts routed keys there)
    assert len(gm.graph.find_nodes(op="output")[0].args[0]) == 3  # logits and each routed layer's routed rows
    assert step.passes[0] == "mod_routing"


def test_what_is_not_built_is_refused():
    spec = load_spec("tiny-llama-mod")
    with pytest.raises(KilnError, match="int8 KV cache is not built for the routed KV cache"):
        compile_step(build_graph(spec.model, seed=0), spec.model, spec.compile, kv_cache_dtype="int8")
    off = CompileConfig(dtype=spec.compile.dtype, extra={**spec.compile.extra, "disable_passes": ["mod_routing"]})
    with pytest.raises(PassError, match="needs the mod_routing pass to run first"):
        compile_step(build_graph(spec.model, seed=0), spec.model, off, use_kernels=False)
    step = compile_step(build_graph(spec.model, seed=0), spec.model, spec.compile, use_kernels=False)
    cache = allocate_kv_cache(step, 4, BS)
    dense_only = StepBatch(*_batch([([1, 2, 3], 0, 3)], [[1]], [[0], [0]], [[[1]], [[1]]]).__dict__.values())
    dense_only.routed_lens = None
    with pytest.raises(KilnError, match="needs routed_lens and routed_block_tables"):
        step(dense_only, cache)
    with pytest.raises(KilnError, match="this model has 2 routed layers"):
        step(_batch([([1, 2, 3], 0, 3)], [[1]], [[0], [0]], [[[1]], [[1]]]), type(cache)(cache.data))


class _CountRows(fx.Interpreter):
    """Runs a step graph as CompiledStep does, noting the rows every linear node's input had at run time, and each
    paged attention's output rows past its last sequence (a routed layer's compact padding rows)."""

    def __init__(self, gm: fx.GraphModule):
        super().__init__(gm)
        self.rows: dict[str, int] = {}
        self.padding: dict[str, torch.Tensor] = {}

    def run_node(self, n):
        out = super().run_node(n)
        op = op_name(n)
        if op == "kiln.linear.default":
            self.rows[n.name] = self.env[n.args[0]].shape[-2]
        elif op == "kiln.paged_attention.default":
            self.padding[n.name] = out[0, int(self.env[n.args[8]][-1]):]  # args[8]: query_start_loc
        return out


@pytest.mark.parametrize(("spec", "use_kernels"), [("tiny-llama-mod", False), ("tiny-llama-mod", True),
                                                   ("tiny-mistral-mod", False)],
                         ids=["llama-reference", "llama-kernels", "mistral-reference"])
def test_the_narrowed_body_equals_the_padded_one_on_fewer_rows(spec, use_kernels, monkeypatch):
    """NARROW_MIN_ROWS lowered to 1 (and buckets of 2 rows): every step narrows each routed layer's body to its
    routed count rounded up to 2; the routing equals the padded path's, the logits and both pools equal them up to
    fp32 rounding, and the routed layers' linears ran on those rows, the dense layers' on all of them."""
    import kiln.passes.kv_cache_routed as kv_cache_routed

    loaded = load_model(spec, device="cpu", seed=4)
    padded = compile_step(copy.deepcopy(loaded.gm), loaded.model, loaded.compile, device="cpu",
                          use_kernels=use_kernels)
    monkeypatch.setattr(kv_cache_routed, "NARROW_MIN_ROWS", 1)
    monkeypatch.setattr(kv_cache_routed, "NARROW_BUCKET", 2)
    narrowed = compile_step(copy.deepcopy(loaded.gm), loaded.model, loaded.compile, device="cpu",
                            use_kernels=use_kernels)
    for step, knobs in ((padded, (256, 64)), (narrowed, (1, 2))):
        nodes = [n for n in step.gm.graph.nodes if n.name.endswith("_mod_narrow")]
        assert [n.name for n in nodes] == ["layers_1_mod_narrow", "layers_3_mod_narrow"]
        assert all(tuple(n.args[2:]) == knobs for n in nodes)
    g = torch.Generator().manual_seed(3)
    seqs = [torch.randint(0, 512, (12,), generator=g).tolist(), torch.randint(0, 512, (8,), generator=g).tolist()]
    caches = [allocate_kv_cache(s, 9, BS, routed_num_blocks=9) for s in (padded, narrowed)]
    tables, routed_tables = [[1, 2, 3], [4, 5, 0]], [[[1, 2, 3], [4, 5, 0]], [[6, 7, 8], [3, 2, 0]]]
    lens = [[0, 0], [0, 0]]
    saw_fewer = narrowed_pad_rows = 0
    for chunks in ([(seqs[0], 0, 7), (seqs[1], 0, 6)], [(seqs[0], 7, 11), (seqs[1], 6, 7)],
                   [(seqs[0], 11, 12), (seqs[1], 7, 8)]):
        batch = _batch(chunks, tables, lens, routed_tables)
        n = batch.tokens.numel()
        outs, rows, pads = [], [], []
        for step, cache in zip((padded, narrowed), caches, strict=True):
            run = _CountRows(step.gm)
            with torch.no_grad():
                outs.append(run.run(*batch.graph_inputs(cache).values()))
            rows.append(run.rows)
            pads.append(run.padding)
        (logits_p, *routed_p), (logits_n, *routed_n) = outs
        # The same routing; the same values up to fp32 rounding, which a GEMM may round differently for another
        # row count (CPU BLAS picks its kernel by M: F.linear of 5 rows and of their first 2 differ by ~5e-6).
        assert all(map(torch.equal, routed_p, routed_n))
        torch.testing.assert_close(logits_n, logits_p, rtol=1e-5, atol=1e-5)
        for cache_p, cache_n in (caches[0].data, caches[1].data), (caches[0].routed, caches[1].routed):
            torch.testing.assert_close(cache_n, cache_p, rtol=1e-5, atol=1e-5)
        counts = [int(r.sum()) for r in routed_n]
        # The padding rows' attention output is zeros on both paths (the reference's; the kernels write it too),
        # so the body never computes on unwritten memory (the module's RuntimeWarnings are errors).
        for name, tail in (*pads[0].items(), *pads[1].items()):
            assert torch.equal(tail, torch.zeros_like(tail)), name
        narrowed_pad_rows += sum(len(tail) for tail in pads[1].values())
        assert rows[0] == {**rows[1], **{k: n for k in rows[1] if k != "logits"}}  # padded: every body on N rows
        for name, got in rows[1].items():
            layer = name.split("_")[1] if name.startswith("layers_") else None
            want = {None: 2, "0": n, "2": n, "1": min(n, -(-max(counts[0], 1) // 2) * 2),
                    "3": min(n, -(-max(counts[1], 1) // 2) * 2)}[layer]  # None: the lm_head's sampled rows
            assert got == want, (name, got, want, counts)
            saw_fewer += got < n and layer in ("1", "3")
        starts = [0, *torch.tensor([b - a for _, a, b in chunks]).cumsum(0).tolist()]
        lens = [[lens[j][i] + int(routed_n[j][starts[i]:starts[i + 1]].sum()) for i in range(2)] for j in range(2)]
    assert saw_fewer >= 4  # the prefill step's routed linears (4 per layer) really ran on fewer rows
    assert narrowed_pad_rows > 0  # rows [count, count rounded up to the bucket) were there to check


@pytest.mark.parametrize("spec_name", SPECS)
def test_each_routed_layer_narrows_its_compact_tensors_once(spec_name):
    """mod_narrow sits after the layer's mod_kv_slots (which read the full index: the routed flags cover all N
    rows) and before its body; the body, the paged write and the scatter read only its outputs."""
    spec = load_spec(spec_name)
    gm = compile_step(build_graph(spec.model, seed=0), spec.model, spec.compile, use_kernels=False).gm
    order = {n: i for i, n in enumerate(gm.graph.nodes)}
    def calls(*ops: str) -> list[fx.Node]:
        return [n for n in gm.graph.nodes if op_name(n) in {f"kiln.{op}.default" for op in ops}]

    routing = calls("mod_route", "mod_gather")
    narrows = calls("mod_narrow")
    assert len(routing) == len(narrows) == 2
    for route, narrow in zip(routing, narrows, strict=True):
        count, compact = narrow.args[:2]
        slots = next(n for n in calls("mod_kv_slots") if n.args[1] is count)
        assert order[route] < order[slots] < order[narrow]
        assert slots.args[0] is compact[0] and compact[0].args == (route, 1 if route.name.endswith("route") else 0)
        full = set(compact)
        assert all(set(n.users) <= {narrow, slots} for n in full)  # nothing else reads the full rows
        cut = {u.args[1]: u for u in narrow.users}
        scatter = next(n for n in calls("mod_scatter") if n.args[4] is count)
        paged = next(n for n in calls("paged_attention") if n.args[5] is cut[len(compact) - 1])
        assert scatter.args[3] is cut[0] and order[narrow] < order[paged] < order[scatter]
        body_start = min(order[u] for i in range(1, len(compact) - 1) for u in cut[i].users)
        assert body_start > order[narrow]
