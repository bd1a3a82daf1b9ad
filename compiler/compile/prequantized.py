"""Linears whose weights arrive already quantized (a GGUF's Q4_0 / Q4_1 / Q8_0 blocks): after gqa_fusion, each
kiln::linear over such a weight becomes kiln::linear_w4 / linear_w8 over the stored codes, scales and minimums as
they are (kiln int4 / int8, group 32), so nothing is requantized."""

from __future__ import annotations

import torch
from torch import fx

from kiln.compile.pipeline import run_pipeline
from kiln.ir.frontend import propagate_fake
from kiln.passes._graph import erase_attr_if_unused, is_call, rename
from kiln.passes.gqa_fusion import PASS as GQA
from kiln.passes.quantize import register_quantized
from kiln.quant.formats import QuantizedWeight

# gqa_fusion's fused weights and the pieces they concatenate (rows, in this order).
_FUSED = {"qkv": ("q", "k", "v"), "gate_up": ("gate", "up")}


def keep_quantized_linears(gm: fx.GraphModule, quantized: dict[str, QuantizedWeight]) -> fx.GraphModule:
    """Fuse q/k/v and gate/up (gqa_fusion), then make each linear whose weight came quantized a linear_w4 over the
    GGUF's own codes (a fused weight over its pieces' rows, concatenated: the blocks run along K, so nothing
    changes)."""
    gm = run_pipeline(gm, [GQA])
    table: dict[str, QuantizedWeight] = {}
    for name, _ in gm.named_parameters():
        if name in quantized:
            table[name] = quantized[name]
            continue
        prefix, _, last = name.removesuffix(".weight").rpartition(".")
        pieces = [f"{prefix}.{p}.weight" for p in _FUSED.get(last, ())]
        parts = [quantized[p] for p in pieces if p in quantized]
        # Pieces of different formats (llama.cpp mixes types per tensor) cannot share one op: that one stays dense.
        if pieces and len(parts) == len(pieces) and len({_form(q) for q in parts}) == 1:
            table[name] = QuantizedWeight(
                torch.cat([q.qweight for q in parts]), torch.cat([q.scales for q in parts]),
                torch.cat([q.zeros for q in parts]) if parts[0].zeros is not None else None, parts[0].bits,
                parts[0].group)
    return _swap_in(gm, table)


def _form(q: QuantizedWeight) -> tuple:
    return q.bits, q.group, None if q.zeros is None else q.zeros.dtype


def _swap_in(gm: fx.GraphModule, table: dict[str, QuantizedWeight]) -> fx.GraphModule:
    """kiln::linear nodes reading a weight in `table` -> kiln::linear_w4 / linear_w8 over its stored tensors."""
    kiln_ops = torch.ops.kiln
    registered: dict[str, dict[str, str]] = {}
    for node in list(gm.graph.nodes):
        if not is_call(node, kiln_ops.linear.default) or str(node.args[1].target) not in table:
            continue
        w_node = node.args[1]
        target = str(w_node.target)
        qw = table[target]
        if target not in registered:
            registered[target] = register_quantized(gm, target, qw)
        names = registered[target]
        bias = node.args[2] if len(node.args) > 2 else None
        with gm.graph.inserting_before(node):
            q, s = gm.graph.get_attr(names["qweight"]), gm.graph.get_attr(names["scales"])
            z = gm.graph.get_attr(names["zeros"]) if "zeros" in names else None
            if qw.bits == 8:
                new = gm.graph.call_function(kiln_ops.linear_w8.default, (node.args[0], q, s, bias))
            else:
                new = gm.graph.call_function(kiln_ops.linear_w4.default, (node.args[0], q, s, z, qw.group, bias))
        node.replace_all_uses_with(new)
        old = node.name
        gm.graph.erase_node(node)
        rename(new, old)
        erase_attr_if_unused(gm, w_node)
    gm.recompile()
    return propagate_fake(gm)
