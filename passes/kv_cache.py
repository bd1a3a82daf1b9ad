"""kv_cache: the Level-1 graph (whole sequences, no cache) becomes the step graph over a paged KV cache.

Matches: a graph whose inputs are `tokens` and `positions` and that holds kiln::attention nodes (or
kiln::flash_attention ones, if flash_tiling ran first: their tile arguments are dropped).
Emits:
- inputs tokens [1, N], positions [1, N] (the flat batch of runtime.step.StepBatch), then slot_mapping [N],
  block_tables [S, max_blocks], context_lens [S], query_start_loc [S + 1], sample_indices [R],
  kv_cache [layers, 2, num_blocks, block_size, kv_heads, head_dim], max_query_len, max_context_len (ints);
- every attention node becomes kiln::paged_attention (kiln.ir.ops_paged) with its cache layer index, which is
  the attention node's ordinal in graph order (one per layer for the usual layer body); windows stay
  per node, so sliding-window layers attend only within their window;
- aten.index_select(·, 1, sample_indices) so the lm_head runs only on the rows sample_indices names (the sampled
  ones, and those scoring prompt tokens for prompt_logprobs): it gathers the final norm's input, or both inputs of
  the residual add that feeds only that norm (so norm_fusion can still fuse the gathered add and norm), or else the
  lm_head's input (a kiln::linear, or linear_w8 / linear_w4 when the quantize pass took the lm_head). The output is
  logits [1, R, vocab].
With an int8 cache (make_pass("int8"); compile_step binds the spec's `kv_cache = paged(dtype = int8)`) the
kv_cache input is int8 and a kv_scales input [layers, 2, num_blocks, block_size, kv_heads] fp32 follows it;
every paged_attention node takes it as its kv_scales argument.

Mixture-of-Depths (the routed KV cache). After mod_routing, a routed layer's attention runs on the compact batch
of the flat batch's routed rows (kiln::mod_route / kiln::mod_gather over [1, N] -> index, count, xs, xpos; the
body reads xs and the original positions xpos). Such an attention (one reachable from a routing node's xs
without passing a kiln::mod_scatter) caches only its layer's routed tokens, in a pool of its own:
- more inputs (kiln.step.step_input_names(routed=True)): routed_lens [routed_layers, S] (each sequence's routed
  length c per routed layer before the step), routed_block_tables [routed_layers, S, max_routed_blocks] and,
  after kv_cache / kv_scales, routed_kv_cache [routed_layers, 2, routed_blocks, block_size, kv_heads, head_dim];
- per routed attention, kiln::mod_kv_slots (kiln.ir.ops_mod_step) computes on the device, from the routing node's
  index and count, the batch's query_start_loc and that layer's lens and table, its own slot_mapping (the j-th
  routed row of sequence s writes entry c_s + j; padding rows -1, not written), block_tables, context_lens
  (c_s + routed count) and query_start_loc (the running sum of the routed counts: compaction keeps the flat
  batch's order, so the compact rows are grouped by sequence); the paged_attention then reads the routed pool at
  its routed layer index with those. max_query_len / max_context_len stay the batch's (upper bounds: a layer
  routes at most a sequence's new tokens, and c_s + count <= the sequence's length);
- the graph returns (logits, routed_0, ..., routed_{R-1}): for each routed layer, which rows of the flat batch it
  routed (int32 [N]), so the host advances c (per-sequence sums), gives back the blocks it reserved for the worst
  case (every new token routed) and knows c at every dense block boundary (for prefix caching);
- per routed layer, right after its routing node: its mod_kv_slots (on the full compact batch, C = N rows), then
  kiln::mod_narrow(count, [index, xs, xpos, slot_mapping...], NARROW_MIN_ROWS, NARROW_BUCKET), whose outputs the
  body, its paged_attention writes and the mod_scatter read instead: on a step of N >= NARROW_MIN_ROWS rows the
  body runs on the routed count rounded up to NARROW_BUCKET rows, not N (ops_mod_step says what is true of
  shapes where: meta["val"] keeps the bound C = N). These nodes and both knobs are passes/kv_cache_routed.py's.
Dense layers keep the kv_cache tensor, their layer index counting dense attentions only. Rotary positions are
the original ones (the body's rope reads xpos), and a sliding window counts routed keys, as in the reference.
The host side (worst-case reservations, c per routed layer, routed prefix caching) is runtime/routed_blocks.py;
the whole design is in docs/ARCHITECTURE.md ("The routed KV cache").
Requires: node.meta["val"] on the attention inputs (for the cache's kv_heads, head_dim and dtype). No pass
strictly: compile_step runs it after mod_routing (for a routed model), gqa_fusion and rope_fusion (gqa_fusion
only fuses projections that feed kiln::attention) and before norm_fusion and flash_tiling (which then finds no
attention left). A routed layer still in the dense-masked form (kiln::routed_attention: mod_routing off) is
refused, as is an int8 cache for a routed model.
"""

from __future__ import annotations

import torch
from torch import fx
from torch._subclasses.fake_tensor import FakeTensorMode

import kiln.ir.ops_level2  # noqa: F401  (registers kiln::flash_attention, which this pass rewrites)
import kiln.ir.ops_mod  # noqa: F401  (registers kiln::mod_route and kiln::mod_gather, which this pass matches)
import kiln.ir.ops_paged  # noqa: F401  (registers kiln::paged_attention)
import kiln.ir.ops_quant  # noqa: F401  (registers kiln::linear_w8 / linear_w4, a quantized lm_head)
from kiln.errors import PassError
from kiln.ir.signatures import ATTENTION, PAGED_ATTENTION, PAGED_STEP
from kiln.model_config import KV_DTYPES
from kiln.passes._graph import is_call, rename
from kiln.passes.base import Pass, PassResult
from kiln.passes.kv_cache_routed import SLOT_OUTPUTS, routed_attention, routed_slots
from kiln.step import KV_CACHE, KV_SCALES, ROUTED_KV_CACHE, STEP_INPUTS, step_input_names

kiln_ops = torch.ops.kiln
_ATTENTION = (kiln_ops.attention.default, kiln_ops.flash_attention.default)
_NORMS = (kiln_ops.rms_norm.default, kiln_ops.layer_norm.default)
# The lm_head, quantized or not (`quantize = int4(lm_head = true)` runs before this pass); each takes x first.
_LM_HEADS = (kiln_ops.linear.default, kiln_ops.linear_w8.default, kiln_ops.linear_w4.default)
# Example sizes for the inputs' meta["val"] (shapes only; the graph is shape-generic), by kiln.step.StepInput's
# symbols; the host-side bounds take them as values (compile_step loads the kernels for this prefill and a decode).
_NUM_BLOCKS, _BLOCK_SIZE = 8, 16
_SIZES = {"N": 8, "S": 2, "R": 2, "W": 4, "WR": 4, "C": 4 * _BLOCK_SIZE}


def _attention_args(node: fx.Node) -> dict:
    """An attention node's kiln::attention arguments by name (a flash_attention's tile arguments follow them)."""
    return ATTENTION.bind(node.args[: len(ATTENTION.params)], node.kwargs)


def _cache_geometry(attn: list[fx.Node]) -> tuple[int, int, torch.dtype]:
    """(kv_heads, head_dim, dtype) shared by every attention node; one cache tensor holds all layers."""
    found = set()
    for n in attn:
        args = _attention_args(n)
        num_kv_heads = args["num_kv_heads"]
        k_val = args["k"].meta.get("val") if isinstance(args["k"], fx.Node) else None
        if not isinstance(k_val, torch.Tensor):
            raise PassError(f"attention %{n.name}: its k input has no meta['val']; propagate shapes first")
        found.add((num_kv_heads, k_val.shape[-1] // num_kv_heads, k_val.dtype))
    if len(found) != 1:
        raise PassError(
            f"attention layers disagree on (kv_heads, head_dim, dtype): {sorted(map(str, found))}; "
            "one paged cache needs one geometry"
        )
    return found.pop()


def _example_inputs(device: torch.device, kv_heads: int, head_dim: int, dtype: torch.dtype, layers: int,
                    routed: int) -> dict:
    """meta["val"] for every input the step graph may take: StepBatch's from their StepInputs, then the caches."""
    sizes = {**_SIZES, "L": routed}
    with FakeTensorMode(allow_non_fake_inputs=True):
        examples: dict = {
            name: torch.empty(spec.example(sizes), dtype=spec.dtype, device=device) if spec.dtype is not None
            else spec.example(sizes)
            for name, spec in STEP_INPUTS.items()
        }  # fmt: skip
        cache = (layers, 2, _NUM_BLOCKS, _BLOCK_SIZE, kv_heads, head_dim)
        examples[KV_CACHE] = torch.empty(cache, dtype=dtype, device=device)
        examples[KV_SCALES] = torch.empty(cache[:-1], dtype=torch.float32, device=device)
        examples[ROUTED_KV_CACHE] = torch.empty((routed, *cache[1:]), dtype=dtype, device=device)
        return examples


def _add_inputs(graph: fx.Graph, examples: dict, names: tuple[str, ...]) -> dict[str, fx.Node]:
    """The step graph's placeholders: the Level-1 graph's (the flat inputs, first in `names`), then the others."""
    nodes = {n.name: n for n in graph.nodes if n.op == "placeholder"}
    last = list(nodes.values())[-1]
    for name in names:
        if name not in nodes:
            with graph.inserting_after(last):
                last = graph.placeholder(name)
            nodes[name] = last
    for name in names:
        nodes[name].meta["val"] = examples[name]
    return nodes


def _gather_sites(logits: fx.Node) -> list[tuple[fx.Node, int]]:
    """(consumer, argument index) pairs whose argument is replaced by its sampled rows."""
    x = logits.args[0]
    if not (is_call(x, _NORMS[0]) or is_call(x, _NORMS[1])) or len(x.users) != 1:
        return [(logits, 0)]
    y = x.args[0]
    if is_call(y, kiln_ops.add.default) and len(y.users) == 1:
        return [(y, 0), (y, 1)]
    return [(x, 0)]


def run(gm: fx.GraphModule, kv_dtype: str = "auto") -> PassResult:
    """The step graph; kv_dtype "auto" caches K/V in the model's dtype, "int8" quantizes them (with scales)."""
    graph = gm.graph
    attn = [n for n in graph.nodes if n.op == "call_function" and n.target in _ATTENTION]
    if not attn:
        return PassResult(gm, modified=False)
    placeholders = [n for n in graph.nodes if n.op == "placeholder"]
    flat = [name for name, spec in STEP_INPUTS.items() if spec.flat]
    if [p.name for p in placeholders] != flat:
        raise PassError(
            f"kv_cache expects a Level-1 graph with inputs ({', '.join(flat)}), got "
            f"({', '.join(p.name for p in placeholders)}); build it with kiln.ir.frontend.build_graph"
        )
    outputs = graph.find_nodes(op="output")[0].args[0]
    logits = outputs[0] if isinstance(outputs, (tuple, list)) else outputs
    if not any(is_call(logits, op) for op in _LM_HEADS):
        raise PassError(f"kv_cache expects the graph output to be the lm_head's kiln::linear (or linear_w8 / "
                        f"linear_w4, quantized), got %{logits.name}")
    masked = [n for n in graph.nodes if is_call(n, kiln_ops.routed_attention.default)]
    if masked:
        raise PassError(f"kv_cache: %{masked[0].name} is a routed layer in the dense-masked form; the routed KV cache "
                        "needs the mod_routing pass to run first (do not disable it for a Mixture-of-Depths model)")
    kv_heads, head_dim, dtype = _cache_geometry(attn)
    weight = next(iter(gm.parameters()), None)  # the weights' device wins: gm.to(device) leaves input metas behind
    device = weight.device if weight is not None else placeholders[0].meta["val"].device
    quantized = kv_dtype == "int8"
    owner = routed_attention(graph, attn)
    if owner and quantized:
        raise PassError("an int8 KV cache is not built for a Mixture-of-Depths model's routed KV cache yet; use "
                        "kv_cache = paged(dtype = auto) (or --kv-cache-dtype auto) for a routed model")
    dense = [n for n in attn if n not in owner]
    routed = [n for n in attn if n in owner]
    examples = _example_inputs(device, kv_heads, head_dim, torch.int8 if quantized else dtype, len(dense), len(routed))
    inputs = _add_inputs(graph, examples, step_input_names(quantized, routed=bool(routed)))
    kv_scales = inputs[KV_SCALES] if quantized else None  # always passed: the op has no default (ops_paged)
    step_args = {p.name: inputs[p.name] for p in PAGED_STEP}

    slot_parts = routed_slots(graph, owner, routed, inputs)
    routed_rows = []
    for node in attn:
        if node in owner:  # the routed layer's own step tensors; the batch's host-side bounds bound them too
            parts = dict(zip(SLOT_OUTPUTS, slot_parts[node], strict=True))
            layer, cache, args_in = routed.index(node), inputs[ROUTED_KV_CACHE], {**step_args, **parts}
            routed_rows.append(parts["routed"])
        else:
            layer, cache, args_in = dense.index(node), inputs[KV_CACHE], step_args
        # the paged op's own parameter names (kiln.ir.signatures.PAGED_CACHE / PAGED_SCALES), not the inputs'
        named = {**_attention_args(node), **args_in, "kv_cache": cache, "layer": layer, "kv_scales": kv_scales}
        with graph.inserting_before(node):
            new = graph.call_function(kiln_ops.paged_attention.default, PAGED_ATTENTION.values(named))
        new.meta["kv_layer"] = layer
        new.meta["kv_routed"] = node in owner
        node.replace_all_uses_with(new)
        name = node.name
        graph.erase_node(node)
        rename(new, name)
    if routed_rows:  # the host learns which rows each routed layer routed with the logits
        out_node = graph.find_nodes(op="output")[0]
        out_node.args = ((logits, *routed_rows),)

    for consumer, i in _gather_sites(logits):
        src = consumer.args[i]
        with graph.inserting_before(consumer):
            gathered = graph.call_function(torch.ops.aten.index_select.default, (src, 1, inputs["sample_indices"]))
        rename(gathered, f"{src.name}_sampled")
        consumer.update_arg(i, gathered)
    return PassResult(gm, modified=True)


def make_pass(kv_dtype: str = "auto") -> Pass:
    """The pass for a KV cache dtype: "auto" (the model's dtype) or "int8"."""
    if kv_dtype not in KV_DTYPES:
        raise PassError(f"KV cache dtype {kv_dtype!r} is not supported; choose one of {', '.join(KV_DTYPES)}")
    return PASS if kv_dtype == "auto" else Pass(name="kv_cache", run=lambda gm: run(gm, kv_dtype), doc=__doc__ or "")


PASS = Pass(name="kv_cache", run=run, doc=__doc__ or "")
