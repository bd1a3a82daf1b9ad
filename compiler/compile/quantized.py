"""Quantized checkpoints: save a quantized graph's tensors once, load them without calibrating again.

A checkpoint directory holds
- model.safetensors: every parameter and persistent buffer of the quantized graph under its graph name
  (qweight / scales / zeros buffers, the unquantized weights, fused qkv / gate_up tensors);
- quantization.json: {"format": "kiln-quantized", "version", "scheme", "passes" (run before quantize: the
  pipeline's, kiln.compile.pipeline.passes_before_quantize), "dtypes", "weights": {original weight name: names of
  its stored tensors}}. The version is the stored layout's (kiln.quant.formats.LAYOUT_VERSION): 2 packs int4 in
  GGML's 32-k block order; a version-1 checkpoint (neighbouring k paired in a byte) is repacked on load, codes
  unchanged; any other version is refused.
- spec.kiln: the model part (a Mixture-of-Depths `route` included), so the directory alone describes the model.
Loading rebuilds the Level-1 graph on the meta device (nothing allocated), re-runs the recorded passes and
the quantize rewrite with the stored tensors, then puts the file's tensors in place.
"""

from __future__ import annotations

import dataclasses
import json
import os
from pathlib import Path

import torch
from torch import fx

import kiln.ir.ops_quant  # noqa: F401  (the quantized ops the graph holds)
from kiln.compile.pipeline import known_passes, passes_before_quantize, run_pipeline
from kiln.errors import InternalError, KilnError, WeightError
from kiln.hf.to_spec import config_to_spec
from kiln.ir.attrs import set_tensor
from kiln.ir.frontend import TORCH_DTYPES, build_graph, propagate_fake, rope_inv_freq
from kiln.ir.graph_builder import INV_FREQ
from kiln.model_config import ModConfig, ModelConfig
from kiln.passes.quantize import rewrite
from kiln.quant.formats import LAYOUT_VERSION, QuantizedWeight, QuantScheme, as_scheme, parse_scheme, repack_int4_v1
from kiln.quant.sizing import resolve_group
from kiln.spec.ast import Call, Keyword, LayerBlock, Name, Num, Setting
from kiln.spec.formatter import format_spec
from kiln.spec.loader import load_spec, parse_and_resolve

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
    passes = gm.meta.get("kiln_passes_before_quantize")  # what quantize_graph ran; else read off the graph
    if passes is None:
        fused = (".qkv.weight", ".gate_up.weight", ".qkv.qweight", ".gate_up.qweight")
        passes = ["gqa_fusion"] if any(k.endswith(fused) for k in tensors) else []
    float_dtypes = {str(t.dtype).removeprefix("torch.") for t in tensors.values() if t.is_floating_point()}
    meta = {
        "format": FORMAT,
        "version": VERSION,
        "scheme": scheme,
        "passes": list(passes),
        "dtypes": sorted(float_dtypes),
        "weights": _stored_weights(gm),
    }
    (out / META).write_text(json.dumps(meta, indent=2) + "\n")
    if cfg is not None:
        (out / SPEC).write_text(spec_text(cfg))
    return out


def _route_expr(route: ModConfig) -> Call:
    decide = (Name("threshold") if route.decide == "threshold"
              else Call("predictor", kwargs=(Keyword("hidden", Num(route.hidden)),)))  # fmt: skip
    kw = (("capacity", Num(route.capacity)), ("every", Num(route.every)), ("decide", decide))
    return Call("mod", kwargs=tuple(Keyword(k, v) for k, v in kw))


def spec_text(cfg: ModelConfig) -> str:
    """spec.kiln's text: cfg's model block (config_to_spec, which writes what a Hugging Face config can say, plus a
    Mixture-of-Depths `route`), checked to read back as cfg: a checkpoint must never load as another model."""
    spec = config_to_spec(cfg)
    if cfg.route is not None:
        items = list(spec.model.items)
        at = next(i for i, item in enumerate(items) if isinstance(item, LayerBlock))
        items.insert(at, Setting("route", _route_expr(cfg.route)))
        spec = dataclasses.replace(spec, model=dataclasses.replace(spec.model, items=tuple(items)))
    text = format_spec(spec)
    back = parse_and_resolve(text, SPEC).model
    if back != cfg:
        lost = [f.name for f in dataclasses.fields(cfg) if getattr(back, f.name) != getattr(cfg, f.name)]
        raise InternalError(f"{SPEC} for model {cfg.name!r} does not read back as the model: {', '.join(lost)} differ")
    return text


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


def stored_dtype(in_dir: str | os.PathLike) -> str:
    """The float dtype (kiln's name) a `kiln quantize` checkpoint's unquantized tensors are in, as load_quantized
    reads it: bf16 or fp16 when any tensor is, else fp32 (the scales are fp32 whatever the model's dtype)."""
    src = Path(in_dir)
    dtypes = _meta(src).get("dtypes")
    if not isinstance(dtypes, list):
        raise WeightError(f"{src / META}: no valid `dtypes`; quantize the model again")
    return next((d for d in ("bf16", "fp16") if str(TORCH_DTYPES[d]).removeprefix("torch.") in dtypes), "fp32")


def check_stored_settings(in_dir: str | os.PathLike, model: ModelConfig, *, quantize: str | None = None,
                          dtype: str | None = None) -> tuple[QuantScheme, str]:
    """A `kiln quantize` checkpoint's scheme and dtype, which were fixed when it was written: a `quantize` (a
    --quantize name) or `dtype` (a kiln dtype name) that agrees is accepted, another is a KilnError (the weights
    cannot be quantized again or re-cast), never silently ignored. `kiln run` and `kiln compile` say the same."""
    src = Path(in_dir)
    have, stored = stored_scheme(src), stored_dtype(src)
    if quantize is not None:
        want = resolve_group(parse_scheme(quantize), model)[0]
        if want.label != have.label:  # calibration options do not matter once the weights are stored
            raise KilnError(
                f"quantize {quantize!r} (--quantize): {src} was quantized by `kiln quantize` with {have.label} and "
                f"cannot be quantized again; leave quantize out, or run `kiln quantize` on the original checkpoint "
                f"with {quantize}"
            )
    if dtype is not None and dtype != stored:
        raise KilnError(
            f"dtype {dtype!r} (--dtype): {src} is a `kiln quantize` checkpoint stored in {stored}, and its dtype is "
            f"fixed when it is written; leave dtype out (or ask for {stored}), or quantize again with "
            f"`kiln quantize --dtype {dtype}`"
        )
    return have, stored


def _mismatch(src: Path, cfg: ModelConfig, detail: str, passes: list[str], tensors: set[str]) -> WeightError:
    """Why a checkpoint's tensors do not fit the model's graph, without blaming the user for what may be kiln's own
    doing: the passes the checkpoint was written after vs the ones this kiln runs before quantize."""
    expected = list(passes_before_quantize(cfg.route is not None))
    routers = sorted(n for n in tensors if ".router." in n)
    if routers and cfg.route is None:
        why = (f"it holds Mixture-of-Depths router weights ({routers[0]}, ...) and model {cfg.name!r} routes no "
               f"layers: a kiln that left `route` out of {SPEC} wrote it; give the routed model's spec (kiln run SPEC "
               f"--weights {src}), or quantize the original model again with this kiln (kiln quantize)")
    elif passes != expected:
        why = (f"it was written after the passes {', '.join(passes) or 'none'} and this kiln quantizes this model "
               f"after {', '.join(expected)}: it comes from another kiln version or another model; quantize the "
               f"original model again with this kiln (kiln quantize)")
    else:
        why = (f"it was written after the same passes as this kiln runs ({', '.join(expected)}), so the model "
               f"differs: a spec given with it is not the one it was quantized from; leave the spec out ({SPEC} "
               f"there describes the model), or quantize again from this spec")
    return WeightError(f"{src}: checkpoint does not match model {cfg.name!r}: {detail}; {why}")


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
    known, passes = known_passes(), meta.get("passes")
    if not isinstance(passes, list) or any(not isinstance(n, str) or n not in known for n in passes):
        raise WeightError(f"{src / META}: `passes` {passes!r} are not passes of this kiln "
                          f"({', '.join(sorted(known))}); quantize the original model again with this kiln "
                          "(kiln quantize)")
    gm = run_pipeline(gm, [known[n] for n in passes])
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
        raise _mismatch(src, cfg, f"quantized weights {bad[:3]} (stored vs the model's graph)", passes,
                        set(tensors))
    try:
        rewrite(gm, scheme, stored)
    except KeyError as e:
        raise WeightError(f"{src}: the spec quantizes weight {e} but the checkpoint has no tensors for it") from None
    expected = gm.state_dict()
    missing = sorted(set(expected) - set(tensors))
    extra = sorted(set(tensors) - set(expected))
    wrong = sorted(k for k in set(expected) & set(tensors) if tuple(expected[k].shape) != tuple(tensors[k].shape))
    if missing or extra or wrong:
        raise _mismatch(src, cfg, f"missing {missing[:5]}, unexpected {extra[:5]}, wrong shape {wrong[:5]}", passes,
                        set(tensors))
    params = {n for n, _ in gm.named_parameters()}
    for name, t in tensors.items():
        _place(gm, name, t, name in params)
    if hasattr(gm, INV_FREQ):
        gm.register_buffer(INV_FREQ, rope_inv_freq(cfg).to(device), persistent=False)
    gm.meta["kiln_quantize"] = scheme.to_dict()
    gm.recompile()
    return propagate_fake(gm)
