"""LoadedModel, what kiln.build.load_model returns, and the settings it is loaded with: resolve_device (--device),
_dtype_error (a --dtype refused), fit_quantize / quantize_label (the compile config's quantize scheme); and say, the
loaders' status line (the `kiln.status` logger).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

import torch

from kiln.errors import KilnError
from kiln.model_config import DTYPE_ALIASES, DTYPE_AUTO, DTYPES, CompileConfig, ModelConfig
from kiln.progress import say
from kiln.quant.formats import as_scheme
from kiln.quant.sizing import resolve_group


@dataclass
class LoadedModel:
    model: ModelConfig
    compile: CompileConfig
    gm: torch.fx.GraphModule
    tokenizer: object  # kiln.tokenizer.Tokenizer
    device: torch.device
    source: str  # where the model description came from (spec path or checkpoint dir)
    # Weights stored quantized (a `kiln quantize` checkpoint's scheme, "gguf" for a GGUF's kept linears): the
    # compile config then asks for no quantize pass, since there is nothing left to quantize.
    stored_quantize: str | None = None
    random_seed: int | None = None  # the seed of seeded random weights, None when weights were loaded
    # The checkpoint's recommended sampling (generation_config.json, read as vLLM's --generation-config auto does),
    # keyed by SamplingParams field names: temperature, top_p, top_k, min_p, repetition_penalty, and max_tokens
    # (from max_new_tokens); only the keys the file sets. {} without a checkpoint, for a GGUF, or with
    # generation_config="vllm". SamplingParams(**generation_defaults) is LLM.get_default_sampling_params().
    generation_defaults: dict[str, object] = field(default_factory=dict)
    generation_source: str | None = None  # the file generation_defaults came from

    def generation_note(self) -> str | None:
        """What a sampling front end says when the checkpoint's defaults apply (as vLLM warns), else None."""
        if not self.generation_defaults:
            return None
        values = ", ".join(f"{k}={v}" for k, v in self.generation_defaults.items())
        return (f"default sampling parameters from {self.generation_source}: {values} (the model's recommendation; "
                "kiln's own defaults with generation_config='vllm' / --generation-config vllm)")

    def weights_label(self) -> str:
        """What the load line says of the weights: random ones must never pass for loaded ones."""
        if self.random_seed is None:
            return ""
        return f", random weights (seed {self.random_seed}; give --weights for real ones)"

    def quantize_label(self) -> str | None:
        """The weights' quantization as run: the compile config's scheme, else how they were stored."""
        return quantize_label(self.compile) or self.stored_quantize


def resolve_device(device: str = "auto") -> torch.device:
    """`auto` picks CUDA when there is one; asking for CUDA without one is an error that says so."""
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise KilnError(f"device {device!r} (--device) was asked for, but torch sees no CUDA device; use cpu or auto")
    if device not in ("cpu",) and not device.startswith("cuda"):
        raise KilnError(f"unknown device {device!r}; expected auto, cpu or cuda[:N]")
    try:
        dev = torch.device(device)
    except RuntimeError:
        raise KilnError(f"unknown device {device!r}; expected auto, cpu or cuda[:N]") from None
    if dev.type == "cuda" and dev.index is not None:
        if dev.index >= torch.cuda.device_count():
            raise KilnError(f"device {device!r} (--device): torch sees {torch.cuda.device_count()} CUDA device(s), "
                            "numbered from 0; pick one of them")
        torch.cuda.set_device(dev)  # Triton launches on the current device (per thread), not the tensors'
    return dev


def _dtype_error(dtype: object) -> str:
    return (f"dtype {dtype!r} (--dtype) is not supported; choose one of {', '.join(DTYPES)}, or vLLM's names: "
            f"{DTYPE_AUTO}, {', '.join(DTYPE_ALIASES)}")


def fit_quantize(comp: CompileConfig, cfg: ModelConfig) -> CompileConfig:
    """The compile config with its quantize scheme (if any) as a QuantScheme whose int4 group fits this model: a
    scheme named without a group takes 128, else the largest group dividing every K, and says so."""
    if not comp.extra.get("quantize"):
        return comp
    scheme, note = resolve_group(as_scheme(comp.extra["quantize"]), cfg)
    if note:
        say(f"note: {note}")
    return dataclasses.replace(comp, extra={**comp.extra, "quantize": scheme})


def quantize_label(comp: CompileConfig) -> str | None:
    """The short name of the compile config's quantize scheme (int8, int4-rtn-g64, ...), None when there is none."""
    return as_scheme(comp.extra["quantize"]).label if comp.extra.get("quantize") else None
