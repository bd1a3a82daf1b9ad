"""A checkpoint's recommended sampling (vLLM's --generation-config): generation_config.json read as SamplingParams
defaults (GENERATION_KEYS, read_generation_defaults) and the choice of where they come from (generation_defaults_for).
"""

from __future__ import annotations

import os
from pathlib import Path

from kiln.errors import KilnError, RequestError
from kiln.runtime.sampling_params import SamplingParams
from kiln.tokenizer import read_json_object

# generation_config.json keys that vLLM's --generation-config auto reads as default sampling parameters, by the
# SamplingParams field each sets (Hugging Face's max_new_tokens is vLLM's max_tokens)
GENERATION_KEYS = {"temperature": "temperature", "top_p": "top_p", "top_k": "top_k", "min_p": "min_p",
                   "repetition_penalty": "repetition_penalty", "max_new_tokens": "max_tokens"}


def read_generation_defaults(directory: str | os.PathLike) -> tuple[dict[str, object], str | None]:
    """(defaults, file): the sampling defaults in `directory`/generation_config.json, keyed by SamplingParams
    field (GENERATION_KEYS; keys the file does not set, or sets to null, are left out), and the file's path; ({},
    None) without the file. Values SamplingParams refuses are a KilnError naming the file."""
    path = Path(directory) / "generation_config.json"
    if not path.is_file():
        return {}, None
    ignore = "or ignore it with generation_config='vllm' (--generation-config vllm)"
    data = read_json_object(path, f"fix the file, {ignore}")
    out = {name: data[key] for key, name in GENERATION_KEYS.items() if data.get(key) is not None}
    try:
        SamplingParams(**out).validate()
    except RequestError as e:
        raise KilnError(f"{path}: {e}; fix the file, {ignore}") from None
    return out, str(path)


def generation_defaults_for(generation_config: str | os.PathLike, checkpoint: Path | None
                            ) -> tuple[dict[str, object], str | None]:
    """vLLM's --generation-config: "auto" reads the checkpoint's generation_config.json (none: {}), "vllm" gives
    {} (kiln's own SamplingParams defaults), a directory reads its generation_config.json."""
    if generation_config == "vllm":
        return {}, None
    if generation_config == "auto":
        return read_generation_defaults(checkpoint) if checkpoint is not None else ({}, None)
    if not isinstance(generation_config, (str, os.PathLike)):
        raise KilnError(f"generation_config = {generation_config!r}: give 'auto', 'vllm' or a directory holding a "
                        "generation_config.json")
    path = Path(generation_config)
    if not (path / "generation_config.json").is_file():
        raise KilnError(f"generation_config {generation_config} (--generation-config): not 'auto' or 'vllm', nor a "
                        "directory holding a generation_config.json; give one of those")
    return read_generation_defaults(path)
