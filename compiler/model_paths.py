"""Where load_model's model comes from: resolve_model_paths (a checkpoint directory or .gguf given as the spec is
the weights; Hub ids and lone weights files refused) and check_weights_dir (what --weights names, if not a checkpoint).
"""

from __future__ import annotations

import os
import re
from pathlib import Path

from kiln.errors import KilnError
from kiln.gguf.files import is_gguf
from kiln.spec.loader import bundled_spec

_WEIGHTS_KINDS = "a Hugging Face checkpoint dir (config.json + *.safetensors), a .gguf file or a `kiln quantize` output"


class WeightsPathError(KilnError):
    """What a weights path names instead of a checkpoint directory (check_weights_dir): `path` and `problem`, the
    message naming it as the --weights flag; a caller that took the path from elsewhere (a draft model's `weights` or
    `spec`) words it as the user wrote it, with `problem`."""

    def __init__(self, path: Path, problem: str):
        super().__init__(f"weights {path} (--weights): {problem}")
        self.path, self.problem = path, problem


def check_weights_dir(path: Path) -> None:
    """WeightsPathError saying what the weights (--weights) name instead of a checkpoint directory: nothing, a spec
    file, another file, or a directory without config.json. Messages read right from the CLI and from LLM(...)."""
    if not path.exists():
        raise WeightsPathError(path, f"does not exist; check the path (give {_WEIGHTS_KINDS})")
    if path.is_file() and path.suffix == ".kiln":
        raise WeightsPathError(path, f"is a spec file, not weights; pass it as the spec (SPEC, e.g. `kiln run {path}`, "
                               "or LLM's first argument), with weights only for its checkpoint")
    if not path.is_dir():
        raise WeightsPathError(path, f"is a file, not a checkpoint directory; give {_WEIGHTS_KINDS}")
    if not (path / "config.json").is_file():
        raise WeightsPathError(path, "no config.json there; point them at a Hugging Face checkpoint dir or a "
                               "directory written by `kiln quantize`")


_HUB_ID = re.compile(r"[A-Za-z0-9][\w.-]*/[\w.-]+")
_WEIGHT_FILES = (".safetensors", ".bin", ".pt", ".pth")


def resolve_model_paths(spec: str | os.PathLike | None, weights: str | os.PathLike | None
                        ) -> tuple[str | os.PathLike | None, str | os.PathLike | None]:
    """(spec, weights) with a model named the vLLM way: a checkpoint directory or a .gguf file in the spec's place
    (`kiln run DIR`, `LLM("model.gguf")`) is taken as the weights, the spec then read from the checkpoint, as
    with weights alone. Giving weights besides is a KilnError, as is a Hugging Face Hub id (kiln downloads
    nothing) or a lone weights file; anything else is left to the spec loader."""
    if spec is None:
        return spec, weights
    text = os.fspath(spec)
    path = Path(text)
    if is_gguf(text) or path.is_dir():
        if weights is not None:
            kind = "a .gguf file" if is_gguf(text) else "a checkpoint directory"
            raise KilnError(f"model {text} is {kind}, and weights {weights} (--weights) name weights too; give the "
                            "checkpoint once: as the model (SPEC, or LLM's first argument) alone, or as weights with "
                            "a .kiln spec or a bundled spec name as the model")
        return None, spec
    if path.is_file() and path.suffix in _WEIGHT_FILES:
        raise KilnError(f"model {text} is one weights file; give the checkpoint directory it is in (config.json + "
                        "*.safetensors), or a .gguf file")
    hub_like = _HUB_ID.fullmatch(text) and not text.endswith((".kiln", ".gguf", ".json"))  # else a missing file
    if hub_like and not path.exists() and bundled_spec(text) is None:
        raise KilnError(f"model {text!r}: no such file or directory here, nor a bundled spec; if it is a Hugging Face "
                        "Hub id: kiln loads local checkpoints only and downloads nothing; download it first (e.g. "
                        f"`huggingface-cli download {text} --local-dir DIR`) and give DIR (`kiln run DIR`, "
                        "`LLM(\"DIR\")`), or give a .gguf file")
    return spec, weights
