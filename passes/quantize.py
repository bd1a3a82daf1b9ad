"""quantize: kiln::linear -> kiln::linear_w8 / kiln::linear_w4, with each weight quantized in the same step.

Matches: kiln::linear nodes whose weight is a get_attr of a 2-D float tensor. The lm_head (the linear reading
lm_head.weight or embed.weight, or whose result is the graph output) only when the scheme says lm_head;
kiln::embedding tables only when it says embeddings (-> kiln::embedding_q).
Emits: per quantized weight `<prefix>.qweight`, `<prefix>.scales` (and `<prefix>.zeros` for asymmetric int4)
as buffers, so weight_bytes counts them; `<prefix>.weight` is deleted once nothing reads it (a tied table the
embedding still reads stays). A weight read by several nodes is quantized once. gm.meta["kiln_quantize"]
records the scheme (quant_io saves it).
Method: rtn quantizes each weight alone; gptq first runs the graph over calibration tokens (kiln.quant.gptq).
A weight whose K is not a multiple of the int4 group is a PassError naming it, K and the group.
Requires: gqa_fusion, so the fused qkv / gate_up weights are quantized once.
"""

from __future__ import annotations

from dataclasses import replace

import torch
from torch import fx

import kiln.ir.ops_quant  # noqa: F401  (registers the quantized ops)
from kiln.errors import KilnError, PassError
from kiln.ir.attrs import get_tensor, set_tensor
from kiln.passes._graph import erase_attr_if_unused, is_call, rename, unique_attr_name
from kiln.passes.base import Pass, PassResult
from kiln.quant.formats import QuantizedWeight, QuantScheme, as_scheme, check_shape, quantize_rtn
from kiln.quant.gptq import calibrate
from kiln.quant.gptq import calibration_ids as make_ids

kiln_ops = torch.ops.kiln
_LM_HEAD_WEIGHTS = ("lm_head.weight", "embed.weight")
_FLOATS = (torch.float32, torch.float16, torch.bfloat16)


def _attr(gm: fx.GraphModule, node: object) -> torch.Tensor | None:
    if not (isinstance(node, fx.Node) and node.op == "get_attr"):
        return None
    return get_tensor(gm, str(node.target))


def _quantizable(gm: fx.GraphModule, weight: object) -> bool:
    t = _attr(gm, weight)
    return t is not None and t.dim() == 2 and t.dtype in _FLOATS


def is_lm_head(node: fx.Node) -> bool:
    return str(node.args[1].target) in _LM_HEAD_WEIGHTS or any(u.op == "output" for u in node.users)


def select(gm: fx.GraphModule, scheme: QuantScheme) -> tuple[list[fx.Node], list[fx.Node]]:
    """(linear nodes, embedding nodes) the scheme quantizes."""
    linears, embeddings = [], []
    for n in gm.graph.nodes:
        if is_call(n, kiln_ops.linear.default) and _quantizable(gm, n.args[1]):
            if scheme.lm_head or not is_lm_head(n):
                linears.append(n)
        elif is_call(n, kiln_ops.embedding.default) and scheme.embeddings and _quantizable(gm, n.args[0]):
            embeddings.append(n)
    return linears, embeddings


def _vocab(gm: fx.GraphModule) -> int:
    for n in gm.graph.nodes:
        if is_call(n, kiln_ops.embedding.default) and _attr(gm, n.args[0]) is not None:
            return _attr(gm, n.args[0]).shape[0]
    raise PassError("GPTQ with random calibration tokens needs the token embedding to know the vocab size")


def _max_positions(gm: fx.GraphModule) -> int | None:
    for n in gm.graph.nodes:
        if is_call(n, kiln_ops.embedding.default) and getattr(n.args[1], "name", None) == "positions":
            return _attr(gm, n.args[0]).shape[0]
    return None


def _set_buffer(gm: fx.GraphModule, name: str, tensor: torch.Tensor) -> None:
    set_tensor(gm, name, tensor, param=False)


def register_quantized(gm: fx.GraphModule, target: str, qw: QuantizedWeight) -> dict[str, str]:
    """Buffer names of qw's tensors, registered next to the weight they replace."""
    prefix = target.removesuffix(".weight")
    names = {}
    for part in ("qweight", "scales", "zeros"):
        t = getattr(qw, part)
        if t is not None:
            names[part] = unique_attr_name(gm, f"{prefix}.{part}")
            _set_buffer(gm, names[part], t)
    return names


def rewrite(gm: fx.GraphModule, scheme: QuantScheme, quantized: dict[str, QuantizedWeight]) -> bool:
    """Replace the selected nodes by quantized ops reading `quantized` (weight name -> stored form)."""
    linears, embeddings = select(gm, scheme)
    graph = gm.graph
    registered: dict[str, dict[str, str]] = {}
    for node in linears + embeddings:
        w_node = node.args[1] if node.target == kiln_ops.linear.default else node.args[0]
        target, dtype = str(w_node.target), _attr(gm, w_node).dtype
        qw = quantized[target]
        if target not in registered:
            registered[target] = register_quantized(gm, target, qw)
        names = registered[target]
        bias = node.args[2] if len(node.args) > 2 else None
        with graph.inserting_before(node):
            q, s = graph.get_attr(names["qweight"]), graph.get_attr(names["scales"])
            z = graph.get_attr(names["zeros"]) if "zeros" in names else None
            if node.target == kiln_ops.embedding.default:
                args = (q, s, z, node.args[1], qw.bits, qw.group, dtype)
                new = graph.call_function(kiln_ops.embedding_q.default, args)
            elif qw.bits == 8:
                new = graph.call_function(kiln_ops.linear_w8.default, (node.args[0], q, s, bias))
            else:
                new = graph.call_function(kiln_ops.linear_w4.default, (node.args[0], q, s, z, qw.group, bias))
        node.replace_all_uses_with(new)
        old_name = node.name
        graph.erase_node(node)
        rename(new, old_name)
        erase_attr_if_unused(gm, w_node)
    if linears or embeddings:
        gm.meta["kiln_quantize"] = scheme.to_dict()
    return bool(linears or embeddings)


def quantize_weights(
    gm: fx.GraphModule, scheme: QuantScheme, *, calibration_ids: torch.Tensor | None = None, tokenizer=None
) -> dict[str, QuantizedWeight]:
    """The stored form of every weight `scheme` selects in gm (RTN, or GPTQ over calibration tokens)."""
    linears, embeddings = select(gm, scheme)
    nodes = [(n, n.args[1]) for n in linears] + [(n, n.args[0]) for n in embeddings]
    for _, w in nodes:
        try:
            check_shape(str(w.target), tuple(_attr(gm, w).shape), scheme)
        except KilnError as e:
            raise PassError(str(e)) from None
    out: dict[str, QuantizedWeight] = {}
    if scheme.method == "gptq" and linears:
        if calibration_ids is None:
            # Learned position tables bound the sequence length (gpt2's 1024, a tiny model's 64).
            seq_len = min(scheme.seq_len, _max_positions(gm) or scheme.seq_len)
            calibration_ids = make_ids(replace(scheme, seq_len=seq_len), _vocab(gm), tokenizer)
        out = calibrate(gm, linears, scheme, calibration_ids)
    for _, w in nodes:
        target = str(w.target)
        if target not in out:
            out[target] = quantize_rtn(_attr(gm, w).detach(), scheme)
    return out


def make_pass(scheme: QuantScheme | dict | str, *, calibration_ids: torch.Tensor | None = None, tokenizer=None) -> Pass:
    """The quantize pass bound to a scheme (a QuantScheme, CompileConfig.extra["quantize"] or a name like int4).

    tokenizer: encodes a GPTQ scheme's calibration file; it must be the model's own (kiln.build.load_model puts it in
    the compile config). None encodes the file as UTF-8 bytes, which are the tokens of a model without a tokenizer
    (kiln's byte-level fallback) and nothing else."""
    scheme = as_scheme(scheme)

    def run(gm: fx.GraphModule) -> PassResult:
        if not any(select(gm, scheme)):
            return PassResult(gm, modified=False)
        with torch.no_grad():
            quantized = quantize_weights(gm, scheme, calibration_ids=calibration_ids, tokenizer=tokenizer)
            return PassResult(gm, modified=rewrite(gm, scheme, quantized))

    return Pass(name="quantize", run=run, requires=("gqa_fusion",), doc=__doc__ or "")


PASS = make_pass(QuantScheme())  # default when named in a pass list: int8 RTN; the spec's scheme replaces it
