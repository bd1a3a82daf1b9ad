"""Typed reading of config.json values, the keys each family reads, and the spec validator applied to them.

Every value is read through a `Reader`, which checks its JSON type (a KilnError naming the key and the file
otherwise) and records which config key fed which spec setting. The range checks (positive sizes, heads
divisible by kv_heads, positive theta and eps, ...) are the spec validator's own: the importer renders the
spec it would write, resolves it in-process, and `refuse_spec_errors` turns any diagnostic into a KilnError
that names the config keys behind it.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field
from typing import Any

from kiln.errors import KilnError, SpecError
from kiln.model_config import RopeConfig, RopeScaling

# Keys every transformers config may carry that do not change a forward pass (bookkeeping, training-only
# settings, generation defaults that old configs still hold). Read by nobody in kiln, on purpose.
GENERIC_KEYS = frozenset(
    """_name_or_path architectures model_type transformers_version torch_dtype dtype use_cache bos_token_id
    eos_token_id pad_token_id sep_token_id decoder_start_token_id initializer_range attention_dropout
    output_attentions output_hidden_states return_dict id2label label2id problem_type chunk_size_feed_forward
    tokenizer_class task_specific_params num_labels finetuning_task prefix use_bfloat16 torchscript pruned_heads
    tf_legacy_loss is_decoder cross_attention_hidden_size tie_encoder_decoder max_length min_length do_sample
    early_stopping num_beams num_beam_groups diversity_penalty temperature top_k top_p typical_p
    repetition_penalty length_penalty no_repeat_ngram_size encoder_no_repeat_ngram_size bad_words_ids
    num_return_sequences output_scores return_dict_in_generate forced_bos_token_id forced_eos_token_id
    remove_invalid_values exponential_decay_length_penalty suppress_tokens begin_suppress_tokens
    use_return_dict is_encoder_decoder""".split()
)
_ROPE = ("rope_theta", "rope_scaling", "rope_parameters", "partial_rotary_factor", "original_max_position_embeddings")
_LLAMA_BASE = (
    "vocab_size hidden_size intermediate_size num_hidden_layers num_attention_heads num_key_value_heads head_dim "
    "hidden_act max_position_embeddings rms_norm_eps tie_word_embeddings".split()
)
# The keys transformers' config class of each family defines (and its model reads). A key outside these and
# GENERIC_KEYS is stored by transformers and never read, so kiln ignores it too, and says so.
FAMILY_KEYS = {
    "llama": frozenset([*_LLAMA_BASE, *_ROPE, "attention_bias", "mlp_bias", "pretraining_tp"]),
    "mistral": frozenset([*_LLAMA_BASE, *_ROPE, "sliding_window", "layer_types"]),
    "ministral": frozenset([*_LLAMA_BASE, *_ROPE, "sliding_window", "layer_types"]),
    "qwen2": frozenset(
        [*_LLAMA_BASE, *_ROPE, "use_sliding_window", "sliding_window", "max_window_layers", "layer_types"]
    ),
    "qwen3": frozenset(
        [*_LLAMA_BASE, *_ROPE, "use_sliding_window", "sliding_window", "max_window_layers", "layer_types",
         "attention_bias"]
    ),
    "gpt2": frozenset(
        """vocab_size n_embd n_head n_layer n_positions n_inner n_ctx hidden_size num_attention_heads
        num_hidden_layers max_position_embeddings activation_function layer_norm_epsilon resid_pdrop embd_pdrop
        attn_pdrop summary_type summary_use_proj summary_activation summary_proj_to_labels summary_first_dropout
        scale_attn_weights scale_attn_by_inverse_layer_idx reorder_and_upcast_attn add_cross_attention
        tie_word_embeddings""".split()
    ),
}
# Keys whose presence changes the model in a way kiln cannot build; refused by name whatever the family.
REFUSED_KEYS = {
    "quantization_config": "pre-quantized HF checkpoints are not supported; load the fp16/bf16/fp32 checkpoint "
    "and quantize with `kiln quantize` or --quantize",
    "is_encoder_decoder": "encoder-decoder models are not supported; kiln builds decoder-only models",
}

_MISSING = object()
# The keys each supported rope type reads from rope_parameters / rope_scaling (besides type and theta).
_ROPE_KEYS = {
    "default": (),
    "linear": ("factor",),
    "llama3": ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"),
}


@dataclass
class Reader:
    """Reads typed values out of one config.json, remembering which key fed which spec setting."""

    hf: dict
    source: str  # the config file, for messages
    origins: dict[str, list[str]] = field(default_factory=dict)  # spec setting -> config keys
    notes: list[str] = field(default_factory=list)  # keys read and deliberately ignored, for the user
    derived: set[str] = field(default_factory=set)  # spec settings computed from other keys (head_dim, ...)

    def derive(self, spec: str, *from_specs: str) -> None:
        self.origins[spec] = [k for s in from_specs for k in self.origins.get(s, [])]
        self.derived.add(spec)

    def _fail(self, key: str, value: Any, want: str) -> KilnError:
        return KilnError(f"{self.source}: config key `{key}` must be {want}, got {value!r}; fix the value in the file")

    def raw(self, *keys: str, required: bool = True) -> tuple[str, Any]:
        """(key, value) of the first of `keys` present and not null; (keys[0], _MISSING) when none is."""
        for key in keys:
            if self.hf.get(key) is not None:
                return key, self.hf[key]
        if required:
            raise KilnError(
                f"{self.source}: config key `{' / '.join(keys)}` is missing; the checkpoint's config is incomplete "
                "(re-save it with transformers' save_pretrained)"
            )
        return keys[0], _MISSING

    def int(self, spec: str, *keys: str, default: Any = _MISSING) -> Any:
        key, value = self.raw(*keys, required=default is _MISSING)
        if value is _MISSING:
            return default
        if type(value) is not int:
            raise self._fail(key, value, "a whole number")
        self.origins.setdefault(spec, []).append(key)
        return value

    def float(self, spec: str, key: str, value: Any = _MISSING, default: float | None = None) -> float:
        if value is _MISSING:
            key, value = self.raw(key, required=default is None)
            if value is _MISSING:
                return float(default)
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise self._fail(key, value, "a number")
        try:
            out = float(value)
        except OverflowError:  # a JSON integer too big for a float
            out = math.inf
        if not math.isfinite(out):
            raise self._fail(key, value, "a finite number")
        self.origins.setdefault(spec, []).append(key)
        return out

    def bool(self, key: str, default: bool) -> bool:
        value = self.hf.get(key)
        if value is None:
            return default
        if not isinstance(value, bool):
            raise self._fail(key, value, "true or false")
        return value

    def str(self, key: str, default: str) -> str:
        value = self.hf.get(key)
        if value is None:
            return default
        if not isinstance(value, str):
            raise self._fail(key, value, "a string")
        return value

    def dict(self, key: str) -> dict:
        value = self.hf.get(key)
        if value is None:
            return {}
        if not isinstance(value, dict):
            raise self._fail(key, value, "an object")
        return dict(value)


def check_keys(hf: dict, model_type: str, source: str) -> list[str]:
    """Refuse keys kiln cannot honour; return the keys transformers ignores for this family (kiln does too)."""
    for key, why in REFUSED_KEYS.items():
        if hf.get(key):
            raise KilnError(f"{source}: config key `{key}` is set: {why}")
    known = FAMILY_KEYS[model_type] | GENERIC_KEYS
    return sorted(k for k in hf if k not in known)


def refuse_spec_errors(err: SpecError, r: Reader) -> KilnError:
    """The spec validator's diagnostics on the generated spec, restated in terms of config.json keys.

    A diagnostic on a derived setting (head_dim from hidden_size / num_attention_heads) whose keys were already
    named is a consequence of the first problem and left out."""
    lines, named = [], set()
    for d in err.diagnostics:
        words = set(re.findall(r"[A-Za-z_]+", d.message.split(",")[0]))
        m = re.match(r"\s*(\w+)\s*=", d.source_line)
        if m:
            words.add(m.group(1))
        keys = sorted({k for spec, ks in r.origins.items() if spec in words for k in ks})
        if m and m.group(1) in r.derived and named & set(keys):
            continue
        named.update(keys)
        where = f"config key {', '.join(f'`{k}`' for k in keys)}" if keys else "config values"
        lines.append(f"{where}: {d.message}")
    return KilnError(f"{r.source}: kiln cannot build this config: " + "; ".join(lines) + "; fix the values in the file")


def rope_config(r: Reader, context: int) -> RopeConfig:
    """The rotary setting, with transformers' precedence between rope_scaling, rope_parameters and rope_theta."""
    # transformers (convert_rope_params_to_dict): a legacy rope_scaling *replaces* rope_parameters; rope_theta
    # and partial_rotary_factor inside it win over the top-level keys, which win over the defaults.
    scaling = r.dict("rope_scaling")
    key, params = ("rope_scaling", scaling) if scaling else ("rope_parameters", r.dict("rope_parameters"))
    if any(isinstance(v, dict) for v in params.values()):
        raise KilnError(f"{r.source}: config key `{key}` holds per-layer-type rotary settings; kiln uses one "
                        "rotary setting for every layer")
    theta = r.float("theta", f"{key}.rope_theta", params["rope_theta"]) if params.get("rope_theta") is not None \
        else r.float("theta", "rope_theta", default=10000.0)
    partial = params.get("partial_rotary_factor", r.hf.get("partial_rotary_factor"))
    if partial is not None and partial != 1.0:
        raise KilnError(f"{r.source}: config key `partial_rotary_factor` is {partial!r}; kiln rotates the whole "
                        "head (only 1.0 is supported)")
    kind = params.get("rope_type", params.get("type", "default"))
    if not isinstance(kind, str):
        raise KilnError(f"{r.source}: config key `{key}.rope_type` must be a string such as \"linear\", got "
                        f"{kind!r}; fix the value in the file")
    used = {"rope_type", "type", "rope_theta", "partial_rotary_factor", *_ROPE_KEYS.get(kind, ())}
    unread = sorted(str(k) for k in params if k not in used)
    if unread and kind in _ROPE_KEYS:
        r.notes.append(f"{r.source}: `{key}` keys that {kind} rope does not use, ignored as transformers does: "
                       f"{', '.join(unread)}")
    if kind == "default":
        return RopeConfig(theta=theta)

    def need(name: str) -> float:
        if params.get(name) is None:
            raise KilnError(f"{r.source}: config key `{key}` ({kind} scaling) has no `{name}`; add it, as "
                            "transformers requires it too")
        return r.float(name if name == "factor" else name.split("_")[0], f"{key}.{name}", params[name])

    if kind == "linear":
        return RopeConfig(theta=theta, scaling=RopeScaling("linear", factor=need("factor")))
    if kind == "llama3":
        factor, low, high = need("factor"), need("low_freq_factor"), need("high_freq_factor")
        if r.hf.get("original_max_position_embeddings") is not None:  # transformers gives the top-level key priority
            original = r.int("original", "original_max_position_embeddings")
        elif params.get("original_max_position_embeddings") is not None:
            original = params["original_max_position_embeddings"]
            if type(original) is not int:
                raise KilnError(f"{r.source}: config key `{key}.original_max_position_embeddings` must be a whole "
                                f"number, got {original!r}; fix the value in the file")
            r.origins.setdefault("original", []).append(f"{key}.original_max_position_embeddings")
        else:
            original = context
        return RopeConfig(theta=theta, scaling=RopeScaling("llama3", factor, low, high, original))
    raise KilnError(f"{r.source}: config key `{key}`: rope scaling {kind!r} is not supported; "
                    "supported: default, linear, llama3")


def _layer_types(r: Reader, layers: int) -> list[str] | None:
    types = r.hf.get("layer_types")
    if types is None:
        return None
    allowed = ("full_attention", "sliding_attention")
    if not isinstance(types, list) or any(t not in allowed for t in types):
        raise KilnError(f"{r.source}: config key `layer_types` must be a list of {' / '.join(allowed)}, got "
                        f"{types!r}; fix the value in the file")
    if len(types) != layers:
        raise KilnError(f"{r.source}: config key `layer_types` has {len(types)} entries but num_hidden_layers is "
                        f"{layers}; give one entry per layer")
    return types


# The config classes' sliding_window when config.json has no such key, as transformers reads it (an explicit null
# means no window; Qwen2 slides only with use_sliding_window)
DEFAULT_SLIDING_WINDOW = {"mistral": 4096, "ministral": 4096, "qwen2": 4096, "qwen3": 4096}
QWEN = ("qwen2", "qwen3")  # the families whose window follows use_sliding_window and max_window_layers


def layer_window(r: Reader, model_type: str, layers: int) -> int | None:
    """The sliding window shared by every layer, or None; kiln's layer body is the same for all layers.

    transformers: mistral slides every layer by `sliding_window`, unless config.json has `layer_types` (then
    AutoConfig loads it as Ministral, which slides only the "sliding_attention" layers, by default all).
    qwen2 and qwen3 slide only with use_sliding_window, on the layers layer_types names, by default those at index
    >= max_window_layers.
    """
    types = _layer_types(r, layers)
    if model_type in QWEN and not r.bool("use_sliding_window", False):
        return None
    if "sliding_window" not in r.hf and model_type in DEFAULT_SLIDING_WINDOW:  # absent: the config class's default
        window = DEFAULT_SLIDING_WINDOW[model_type]
        r.origins.setdefault("window", []).append(f"sliding_window (absent: the class default {window})")
    else:  # null: no window
        window = r.int("window", "sliding_window", default=None)
    if window is None:
        return None
    if types is None and model_type in QWEN:
        first = r.int("max_window_layers", "max_window_layers", default=28)  # Qwen2Config's and Qwen3Config's
        types = ["sliding_attention" if i >= first else "full_attention" for i in range(layers)]
    if types is None or set(types) == {"sliding_attention"}:
        return window
    if set(types) == {"full_attention"}:
        return None
    sliding = [i for i, t in enumerate(types) if t == "sliding_attention"]
    fix = ("set max_window_layers to 0 or >= num_hidden_layers" if model_type in QWEN and "layer_types" not in r.hf
           else "a checkpoint trained with mixed layers cannot be served with one setting")
    raise KilnError(
        f"{r.source}: {model_type} with a sliding window on some layers only (config key `layer_types`: layers "
        f"{sliding} slide, the others attend fully) is not supported; kiln applies one attention setting to every "
        f"layer ({fix})"
    )
