"""The options of backend="kiln" (`torch.compile(..., options={...})`), checked up front: kiln.dynamo.backend's
docstring says what each does."""

from __future__ import annotations

import difflib
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kiln import env
from kiln.compile.driver import resolve_use_kernels
from kiln.compile.pipeline import known_passes
from kiln.dynamo.claims import CLAIMABLE
from kiln.errors import KilnError

FALLBACKS = ("inductor", "eager")
MODES = ("default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs")
OPTIONS = ("claims", "dump_dir", "fallback", "mode", "passes", "use_kernels")
# Passes of kiln's own pipelines that have nothing to work on in a region of a Dynamo graph (False is allowed).
NOT_FOR_DYNAMO = {
    "kv_cache": "builds the serving step graph over a paged KV cache from a whole kiln model graph",
    "mod_routing": "rewrites the Mixture-of-Depths layers of a kiln spec",
}


@dataclass(frozen=True)
class Options:
    fallback: str = "inductor"
    dump_dir: str | None = None
    use_kernels: bool | None = None
    passes: dict[str, bool] | None = None
    mode: str = "default"
    off: frozenset[str] = frozenset()  # kiln ops not claimed (option claims)


def _passes_option(passes: Any) -> dict[str, bool] | None:
    if passes is None:
        return None

    known = sorted(known_passes())
    if not isinstance(passes, dict) or not all(isinstance(v, bool) for v in passes.values()):
        raise KilnError(
            f"option passes={passes!r} for backend 'kiln'; expected a dict of pass name -> True / False, "
            f"e.g. {{'flash_tiling': False}}; known passes: {', '.join(known)}"
        )
    unknown = sorted(str(n) for n in passes if n not in known)
    if unknown:
        raise KilnError(f"option passes names unknown pass(es) {', '.join(unknown)}; known passes: {', '.join(known)}")
    refused = sorted(n for n, on in passes.items() if on and n in NOT_FOR_DYNAMO)
    if refused:
        why = "; ".join(f"{n} {NOT_FOR_DYNAMO[n]}" for n in refused)
        usable = ", ".join(n for n in known if n not in NOT_FOR_DYNAMO)
        raise KilnError(
            f"option passes turns on {', '.join(refused)}, which cannot run on a torch.compile graph: {why}; "
            f"passes for backend 'kiln': {usable}"
        )
    return dict(passes)


def _claims_option(claims: Any) -> frozenset[str]:
    if claims is None:
        return frozenset()
    if not isinstance(claims, dict) or not all(isinstance(v, bool) for v in claims.values()):
        raise KilnError(
            f"option claims={claims!r} for backend 'kiln'; expected a dict of kiln op -> True / False, "
            f"e.g. {{'attention': False}}; ops: {', '.join(CLAIMABLE)}"
        )
    unknown = sorted(str(op) for op in claims if op not in CLAIMABLE)
    if unknown:
        raise KilnError(f"option claims names unknown kiln op(s) {', '.join(unknown)}; ops: {', '.join(CLAIMABLE)}")
    return frozenset(op for op, on in claims.items() if not on)


def _dump_option(dump: Any) -> str | None:
    if not dump:
        return None
    if not isinstance(dump, (str, os.PathLike)):
        raise KilnError(f"option dump_dir={dump!r} for backend 'kiln'; expected a directory path (str or Path)")
    path = Path(dump)
    try:  # fail now, naming the option, rather than with an OSError deep inside the first compile
        path.mkdir(parents=True, exist_ok=True)
        probe = path / ".kiln-write-test"
        probe.write_text("")
        probe.unlink()
    except OSError as e:
        raise KilnError(
            f"option dump_dir={str(dump)!r} (or KILN_DUMP_DIR) is not a writable directory ({e.strerror or e}); "
            "pass a directory kiln may create and write, or leave dump_dir out"
        ) from None
    return str(path)


def parse_options(options: dict[str, Any] | None, mode: str | None = None) -> Options:
    """The backend's options checked up front (mode: torch.compile's mode= argument, when it was given)."""
    if options is not None and not isinstance(options, dict):
        raise KilnError(f"options={options!r} for backend 'kiln'; expected a dict with keys among {', '.join(OPTIONS)}")
    options = dict(options or {})
    unknown = sorted(set(options) - set(OPTIONS), key=str)
    if unknown:
        close = [m for n in unknown for m in difflib.get_close_matches(str(n), OPTIONS, n=1, cutoff=0.75)]
        hint = f" (did you mean {', '.join(map(repr, close))}?)" if close else ""
        raise KilnError(f"unknown option(s) {', '.join(map(repr, unknown))} for backend 'kiln'{hint}; allowed: "
                        f"{', '.join(OPTIONS)}")
    fallback = options.get("fallback", "inductor")
    if fallback not in FALLBACKS:
        raise KilnError(f"option fallback={fallback!r} for backend 'kiln'; expected one of {', '.join(FALLBACKS)}")
    mode = options.get("mode", mode) or "default"
    if mode not in MODES:
        raise KilnError(f"mode={mode!r} for backend 'kiln'; expected one of {', '.join(MODES)}")
    if mode != "default" and fallback != "inductor":
        raise KilnError(
            f"mode={mode!r} with fallback={fallback!r}: modes are inductor's (CUDA graphs, autotuning); "
            "use fallback='inductor' (the default) or leave mode out"
        )
    use_kernels = options.get("use_kernels")
    if use_kernels is not None and not isinstance(use_kernels, bool):  # not 1 / 0, which `in (True, False)` takes
        raise KilnError(f"option use_kernels={use_kernels!r}; expected True, False or None")
    if use_kernels:
        resolve_use_kernels(use_kernels, "option use_kernels")
    dump = _dump_option(options.get("dump_dir") or env.dump_dir())
    passes = _passes_option(options.get("passes"))
    return Options(fallback, dump, use_kernels, passes, mode, _claims_option(options.get("claims")))
