"""From (spec, checkpoint, flags) to a ready-to-run model: the one place the CLI and the Python API share."""

from __future__ import annotations

import dataclasses
import os
import sys
from dataclasses import dataclass
from pathlib import Path

import torch

from kiln.errors import KilnError
from kiln.model_config import DTYPES, CompileConfig, ModelConfig

TORCH_DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}


@dataclass
class LoadedModel:
    model: ModelConfig
    compile: CompileConfig
    gm: torch.fx.GraphModule
    tokenizer: object  # kiln.tokenizer.Tokenizer
    device: torch.device
    source: str  # where the model description came from (spec path or checkpoint dir)


def resolve_device(device: str = "auto") -> torch.device:
    """`auto` picks CUDA when there is one; asking for CUDA without one is an error that says so."""
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise KilnError("--device cuda was asked for but torch sees no CUDA device; use --device cpu or auto")
    if device not in ("cpu",) and not device.startswith("cuda"):
        raise KilnError(f"unknown device {device!r}; expected auto, cpu or cuda[:N]")
    return torch.device(device)


def _model_from_checkpoint(weights: Path) -> tuple[ModelConfig, str]:
    from kiln.hf_import import config_from_hf, load_hf_config

    hf = load_hf_config(weights)
    return config_from_hf(hf, name=weights.name), hf.get("model_type", "")


def load_model(
    spec: str | os.PathLike | None = None,
    weights: str | os.PathLike | None = None,
    *,
    dtype: str | None = None,
    device: str = "auto",
    seed: int = 0,
    quantize: str | None = None,
) -> LoadedModel:
    """Build the Level-1 graph with weights.

    spec: a .kiln path or a bundled spec name; when None it is read from the checkpoint's config.json, or the
    bundled default spec is used when there is no checkpoint either. weights: a HF checkpoint directory; when
    None the weights are seeded random. dtype and quantize (a scheme name such as int8 or int4-gptq-g128)
    override the spec's compile part (CLI flags win).
    """
    from kiln.frontend import build_graph
    from kiln.spec_loader import DEFAULT_SPEC, load_spec
    from kiln.tokenizer import load_tokenizer

    dev = resolve_device(device)
    from kiln.gguf_load import bundled_weights, is_gguf, load_gguf_model

    weights = weights if weights is not None else bundled_weights(spec)  # a bundled spec may name a packaged GGUF
    if is_gguf(weights):
        return load_gguf_model(spec, weights, dtype=dtype, dev=dev, seed=seed, quantize=quantize)
    weights_dir = Path(weights) if weights is not None else None
    if weights_dir is not None:
        from kiln.quant_io import is_quantized_checkpoint

        if is_quantized_checkpoint(weights_dir):
            return _load_quantized(weights_dir, spec, dev)
    if weights_dir is not None and not (weights_dir / "config.json").is_file():
        raise KilnError(f"--weights {weights_dir}: no config.json there; point it at a Hugging Face checkpoint dir "
                        "or a directory written by `kiln quantize`")

    model_type = ""
    if spec is None and weights_dir is not None:
        cfg, model_type = _model_from_checkpoint(weights_dir)
        comp, source = CompileConfig(), str(weights_dir)
    else:
        loaded = load_spec(spec if spec is not None else DEFAULT_SPEC)
        cfg, comp, source = loaded.model, loaded.compile, loaded.path
        if weights_dir is not None:
            model_type = _model_from_checkpoint(weights_dir)[1]

    if dtype is not None:
        if dtype not in DTYPES:
            raise KilnError(f"--dtype {dtype!r} is not supported; choose one of {', '.join(DTYPES)}")
        comp = dataclasses.replace(comp, dtype=dtype)
    if quantize is not None:
        from kiln.quantization import parse_scheme

        comp = dataclasses.replace(comp, extra={**comp.extra, "quantize": parse_scheme(quantize)})
    tdtype = TORCH_DTYPES[comp.dtype]

    params = None
    if weights_dir is not None:
        from kiln.weights import load_hf_weights

        params = load_hf_weights(weights_dir, cfg, model_type=model_type, dtype=tdtype, device=dev)
    gm = build_graph(cfg, params, dtype=tdtype, device=dev, seed=seed)
    tokenizer = load_tokenizer(weights_dir, vocab=cfg.vocab)
    return LoadedModel(model=cfg, compile=comp, gm=gm, tokenizer=tokenizer, device=dev, source=source)


def _load_quantized(weights_dir: Path, spec: str | os.PathLike | None, dev: torch.device) -> LoadedModel:
    """A checkpoint written by `kiln quantize`: its graph is already passed (fusion + quantize), no calibration."""
    from kiln.quant_io import SPEC, load_quantized
    from kiln.spec_loader import load_spec
    from kiln.tokenizer import load_tokenizer

    loaded = load_spec(spec if spec is not None else weights_dir / SPEC)
    gm = load_quantized(weights_dir, loaded.model, device=dev)
    dtype = next((k for k, v in TORCH_DTYPES.items() if v == gm.get_parameter("embed.weight").dtype), "fp32")
    comp = dataclasses.replace(loaded.compile, dtype=dtype)
    tokenizer = load_tokenizer(weights_dir, vocab=loaded.model.vocab)
    return LoadedModel(loaded.model, comp, gm, tokenizer, dev, source=str(weights_dir))


def say(msg: str) -> None:
    """A one-line status message for humans, on stderr so stdout stays clean for text and JSON."""
    print(f"kiln: {msg}", file=sys.stderr, flush=True)
