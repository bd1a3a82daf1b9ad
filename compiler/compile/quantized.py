"""Quantized checkpoints: save a quantized graph's tensors once, load them without calibrating again.

A checkpoint directory holds
- model.safetensors: every parameter and persistent buffer of the quantized graph under its graph name
  (qweight / scales / zeros buffers, the unquantized weights, fused qkv / gate_up tensors);
- quantization.json: {"format": "kiln-quantized", "version", "scheme", "passes" (run before quantize), "dtype",
  "weights": {original weight name: names of its stored tensors}}. The version is the stored layout's
  (kiln.quant.formats.LAYOUT_VERSION): 2 packs int4 in GGML's 32-k block order; a version-1 checkpoint (neighbouring
  k paired in a byte) is repacked on load, codes unchanged; any other version is refused.
- spec.kiln: the model part, so the directory alone describes the model.
Loading rebuilds the Level-1 graph on the meta device (nothing allocated), re-runs the recorded passes and
the quantize rewrite with the stored tensors, then puts the file's tensors in place.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch
from torch import fx

import kiln.ir.ops_quant  # noqa: F401  (the quantized ops the graph holds)
from kiln.compile.pipeline import known_passes
from kiln.errors import WeightError
from kiln.hf.to_spec import config_to_spec
from kiln.ir.attrs import set_tensor
from kiln.ir.frontend import build_graph, propagate_fake, rope_inv_freq
from kiln.ir.graph_builder import INV_FREQ
from kiln.model_config import ModelConfig
from kiln.passes.quantize import rewrite
from kiln.quant.formats import LAYOUT_VERSION, QuantizedWeight, QuantScheme, as_scheme, repack_int4_v1
from kiln.spec.formatter import format_spec
from kiln.spec.loader import load_spec

FORMAT = "kiln-quantized"
VERSION = LAYOUT_VERSION  # what save_quantized writes; load_quantized also reads READABLE
READABLE = (1, LAYOUT_VERSION)
TENSORS, META, SPEC = "model.safetensors", "quantization.json", "spec.kiln"


def is_quantized_checkpoint(path: str | os.PathLike) -> bool:
    return (Path(path) / META).is_file() and (Path(path) / TENSORS).is_file()


def _stored_weights(gm: fx.GraphModule) -> dict[str, dict]:
    """{original weight name: {"qweight", "scales", ("zeros",) "bits", "group"}} read off the quantized ops."""
    ops = torch.ops.kiln
    out: dict[str, dict] = {}
    for n in gm.graph.nodes:
        if n.op != "call_function":
            continue
        if n.target == ops.linear_w8.default:
            q, s, z, bits, group = n.args[1], n.args[2], None, 8, 0
        elif n.target == ops.linear_w4.default:
            q, s, z, bits, group = n.args[1], n.args[2], n.args[3], 4, n.args[4]
        elif n.target == ops.embedding_q.default:
            q, s, z, bits, group = n.args[0], n.args[1], n.args[2], n.args[4], n.args[5]
        else:
            continue
        entry = {"qweight": str(q.target), "scales": str(s.target), "bits": bits, "group": group}
        if z is not None:
            entry["zeros"] = str(z.target)
        out[str(q.target).removesuffix(".qweight") + ".weight"] = entry
    return out


def save_quantized(gm: fx.GraphModule, out_dir: str | os.PathLike, cfg: ModelConfig | None = None) -> Path:
    """Write a quantized graph (the quantize pass has run) to out_dir; returns the directory."""
    from safetensors.torch import save_file

    scheme = gm.meta.get("kiln_quantize")
    if scheme is None:
        raise WeightError("save_quantized: this graph has not been quantized (run the quantize pass first)")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tensors, seen = {}, set()
    for name, t in gm.state_dict().items():
        t = t.detach().to("cpu").contiguous()
        if t.data_ptr() in seen and t.numel():  # safetensors refuses shared storage
            t = t.clone()
        seen.add(t.data_ptr())
        tensors[name] = t
    save_file(tensors, str(out / TENSORS))
    fused = any(k.endswith((".qkv.weight", ".gate_up.weight", ".qkv.qweight", ".gate_up.qweight")) for k in tensors)
    float_dtypes = {str(t.dtype).removeprefix("torch.") for t in tensors.values() if t.is_floating_point()}
    meta = {
        "format": FORMAT,
        "version": VERSION,
        "scheme": scheme,
        "passes": ["gqa_fusion"] if fused else [],
        "dtypes": sorted(float_dtypes),
        "weights": _stored_weights(gm),
    }
    (out / META).write_text(json.dumps(meta, indent=2) + "\n")
    if cfg is not None:
        (out / SPEC).write_text(format_spec(config_to_spec(cfg)))
    return out


def _meta(src: Path) -> dict:
    try:
        meta = json.loads((src / META).read_bytes().decode("utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError, RecursionError) as e:
        raise WeightError(f"{src / META}: not valid JSON ({e}); quantize the model again") from None
    if not isinstance(meta, dict):
        raise WeightError(f"{src / META}: not a JSON object; quantize the model again")
    return meta


def stored_scheme(in_dir: str | os.PathLike) -> QuantScheme:
    """The quantization scheme a `kiln quantize` checkpoint was written with."""
    src = Path(in_dir)
    try:
        return as_scheme(_meta(src)["scheme"])
    except (KeyError, TypeError) as e:
        raise WeightError(f"{src / META}: no valid `scheme` ({e}); quantize the model again") from None


def _place(gm: fx.GraphModule, name: str, tensor: torch.Tensor, param: bool) -> None:
    set_tensor(gm, name, tensor, param=param)


def load_quantized(
    in_dir: str | os.PathLike, cfg: ModelConfig | None = None, *, device: str | torch.device = "cpu"
) -> fx.GraphModule:
    """The quantized graph saved in in_dir, on `device`; cfg defaults to the directory's spec.kiln."""
    from safetensors.torch import load_file

    src = Path(in_dir)
    if not is_quantized_checkpoint(src):
        raise WeightError(f"{src}: not a kiln quantized checkpoint (expected {META} and {TENSORS} there)")
    meta = _meta(src)
    if meta.get("format") != FORMAT or meta.get("version") not in READABLE:
        raise WeightError(
            f"{src / META}: format {meta.get('format')} v{meta.get('version')}, expected {FORMAT} "
            f"v{' or v'.join(map(str, READABLE))}; quantize the model again with this kiln version (kiln quantize)"
        )
    if cfg is None:
        cfg = load_spec(src / SPEC).model
    try:
        tensors = load_file(str(src / TENSORS), device=str(device))
    except Exception as e:  # safetensors raises its own error type (and OSError) on a cut or corrupt file
        raise WeightError(f"{src / TENSORS}: not a readable safetensors file ({type(e).__name__}: {e}); the file "
                          "is corrupt or truncated: run kiln quantize again") from None
    if meta["version"] == 1:  # int4 codes paired by neighbouring k: the same codes in today's block order
        for e in meta.get("weights", {}).values():
            if isinstance(e, dict) and e.get("bits") == 4 and e.get("qweight") in tensors:
                tensors[e["qweight"]] = repack_int4_v1(tensors[e["qweight"]])
    dtypes = {t.dtype for t in tensors.values() if t.is_floating_point() and t.dim() >= 1}
    dtype = next((d for d in (torch.bfloat16, torch.float16) if d in dtypes), torch.float32)
    gm = build_graph(cfg, dtype=dtype, device="meta")
    passes = known_passes()
    for name in meta["passes"]:
        passes[name].run(gm)
    scheme = as_scheme(meta["scheme"])
    stored = {
        w: QuantizedWeight(tensors[e["qweight"]], tensors[e["scales"]], tensors.get(e.get("zeros", "")),
                           e["bits"], e["group"])
        for w, e in meta["weights"].items()
    }  # fmt: skip
    shapes = dict(gm.state_dict())
    bad = [f"{w} {list(q.shape)} vs {list(shapes[w].shape) if w in shapes else 'absent'}"
           for w, q in stored.items() if w not in shapes or tuple(shapes[w].shape) != q.shape]  # fmt: skip
    if bad:
        raise WeightError(f"{src}: checkpoint does not match model {cfg.name!r}: quantized weights {bad[:3]} "
                          "(stored vs the spec's); was it saved from another spec?")
    try:
        rewrite(gm, scheme, stored)
    except KeyError as e:
        raise WeightError(f"{src}: the spec quantizes weight {e} but the checkpoint has no tensors for it") from None
    expected = gm.state_dict()
    missing = sorted(set(expected) - set(tensors))
    extra = sorted(set(tensors) - set(expected))
    wrong = sorted(k for k in set(expected) & set(tensors) if tuple(expected[k].shape) != tuple(tensors[k].shape))
    if missing or extra or wrong:
        raise WeightError(
            f"{src}: checkpoint does not match model {cfg.name!r}: missing {missing[:5]}, "
            f"unexpected {extra[:5]}, wrong shape {wrong[:5]}; was it saved from another spec?"
        )
    params = {n for n, _ in gm.named_parameters()}
    for name, t in tensors.items():
        _place(gm, name, t, name in params)
    if hasattr(gm, INV_FREQ):
        gm.register_buffer(INV_FREQ, rope_inv_freq(cfg).to(device), persistent=False)
    gm.meta["kiln_quantize"] = scheme.to_dict()
    gm.recompile()
    return propagate_fake(gm)
