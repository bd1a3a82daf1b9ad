"""The weight plan: for every tensor a Hugging Face checkpoint of a model_type must hold for a ModelConfig, its HF
name, the shape it must have, the kiln names it fills and how (as is, transposed for GPT-2's Conv1D, or split for
GPT-2's fused qkv). kiln.hf.weights checks a checkpoint against it and loads by it.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass

import torch

from kiln.errors import KilnError, WeightError
from kiln.model_config import ModelConfig, param_shapes

Convert = Callable[[torch.Tensor], tuple[torch.Tensor, ...]]
HF_PREFIX = {"llama": "model.", "mistral": "model.", "ministral": "model.", "qwen2": "model.", "qwen3": "model.",
           "gpt2": "transformer."}
_SITES = {  # kiln site -> HF module, per naming scheme
    "llama": {"norm0": "input_layernorm", "attn0": "self_attn", "norm1": "post_attention_layernorm", "mlp0": "mlp"},
    "gpt2": {"norm0": "ln_1", "attn0": "attn", "norm1": "ln_2", "mlp0": "mlp"},
}
_LLAMA_PROJ = {
    "q": "q_proj",
    "k": "k_proj",
    "v": "v_proj",
    "o": "o_proj",
    "q_norm": "q_norm",  # Qwen3's per-head q/k norms
    "k_norm": "k_norm",
    "gate": "gate_proj",
    "up": "up_proj",
    "down": "down_proj",
}
_GPT2_PROJ = {"o": "c_proj", "up": "c_fc", "down": "c_proj"}


@dataclass(frozen=True)
class Source:
    """One checkpoint tensor: its HF name, the shape it must have, and the kiln tensors made from it."""

    hf: str
    shape: tuple[int, ...]
    targets: tuple[str, ...]
    convert: Convert = lambda t: (t,)


def _transpose(t: torch.Tensor) -> tuple[torch.Tensor, ...]:
    return (t.t(),)


def _split_qkv(sizes: tuple[int, int, int]) -> Convert:
    return lambda t: tuple(p.t() if t.dim() == 2 else p for p in torch.split(t, sizes, dim=-1))


def weight_plan(cfg: ModelConfig, model_type: str) -> list[Source]:
    """The checkpoint tensors a HF model of `model_type` must hold for `cfg`, with their kiln names."""
    if model_type not in HF_PREFIX:
        raise KilnError(f"no HF weight mapping for model_type {model_type!r}; supported: {', '.join(HF_PREFIX)}")
    gpt2 = model_type == "gpt2"
    shapes = param_shapes(cfg)
    sites = _SITES["gpt2" if gpt2 else "llama"]
    pre = HF_PREFIX[model_type]
    plan: list[Source] = []
    done: set[str] = set()

    def direct(kiln: str, hf: str, transpose: bool = False) -> None:
        shape = shapes[kiln][::-1] if transpose else shapes[kiln]
        plan.append(Source(hf, shape, (kiln,), _transpose if transpose else Source.convert))
        done.add(kiln)

    direct("embed.weight", pre + ("wte.weight" if gpt2 else "embed_tokens.weight"))
    if "pos_embed.weight" in shapes:
        direct("pos_embed.weight", pre + "wpe.weight")
    for name in shapes:
        routed = re.fullmatch(r"layers\.(\d+)\.(router\..+)", name)
        if routed:  # Mixture-of-Depths routers: no HF counterpart; kept under the layer's prefix, kiln's names
            direct(name, f"{pre}{'h' if gpt2 else 'layers'}.{routed.group(1)}.{routed.group(2)}")
            continue
        m = re.fullmatch(r"layers\.(\d+)\.(\w+)\.(?:(\w+)\.)?(weight|bias)", name)
        if not m or name in done:
            continue
        layer, site, proj, kind = m.groups()
        if site not in sites:
            raise KilnError(
                f"weight {name}: site {site} has no HF counterpart; HF import supports the standard "
                "pre-norm block (norm0, attn0, norm1, mlp0)"
            )
        hf = f"{pre}{'h' if gpt2 else 'layers'}.{layer}.{sites[site]}."
        if proj is None:
            direct(name, hf + kind)
        elif not gpt2:
            direct(name, hf + f"{_LLAMA_PROJ[proj]}.{kind}")
        elif proj in ("q", "k", "v"):
            names = tuple(f"layers.{layer}.{site}.{p}.{kind}" for p in ("q", "k", "v"))
            sizes = tuple(shapes[n][0] for n in names)
            shape = (cfg.dim, sum(sizes)) if kind == "weight" else (sum(sizes),)
            plan.append(Source(hf + f"c_attn.{kind}", shape, names, _split_qkv(sizes)))
            done.update(names)
        elif proj in _GPT2_PROJ:
            direct(name, hf + f"{_GPT2_PROJ[proj]}.{kind}", transpose=kind == "weight")
        else:  # e.g. a gated MLP in the spec: gpt2 checkpoints have only c_fc and c_proj
            raise WeightError(f"weight {name}: gpt2 checkpoints have no {proj} projection; the spec does not match")
    for suffix in ("weight", "bias"):
        if f"final_norm.{suffix}" in shapes:
            direct(f"final_norm.{suffix}", pre + ("ln_f." if gpt2 else "norm.") + suffix)
    if "lm_head.weight" in shapes:
        direct("lm_head.weight", "lm_head.weight")
    assert done == set(shapes), f"unmapped kiln weights: {sorted(set(shapes) - done)}"
    return plan
