"""The compile block: `dtype`, `quantize`, `kv_cache`, `attention`, `speculation` -> CompileConfig (dtype + extra)."""

from __future__ import annotations

from pathlib import Path

from kiln.model_config import DTYPES, INT4_GROUPS, KV_BLOCK_MAX, KV_DTYPES, CompileConfig
from kiln.spec.ast import CompileBlock, Expr, Num, Str
from kiln.spec.formatter import format_expr
from kiln.spec.speculation import speculation_value
from kiln.spec.values import _bool, _config_call, _enum, _int, _Report, _unique

COMPILE_KEYS = ("dtype", "quantize", "kv_cache", "attention", "speculation")
# Keys that belong elsewhere: the message and the hint a compile block using one gets.
PLANNED_COMPILE_KEYS = {
    "routing": ("Mixture-of-Depths routing is a model setting, `route`, not a compile setting: it changes what the "
                "model computes", "move it into the model block, e.g. route = mod(capacity = 0.125, every = 2)"),
    "route": ("`route` (Mixture-of-Depths routing) is a model setting, not a compile setting: it changes what the "
              "model computes", "move the line into the model block"),
}
TILE_WARPS = (1, 2, 4, 8, 16)
_QUANT_COMMON = ("method", "calibration", "tokens", "lm_head", "embeddings")
QUANT_FUNCS = {"int8": _QUANT_COMMON, "int4": ("group", "symmetric", *_QUANT_COMMON)}


def _quantize(r: _Report, e: Expr) -> dict | None:
    """`quantize = int8` or `int4(group = 128, method = gptq, ...)` -> the kwargs of kiln.quant.formats.QuantScheme."""
    found = _config_call(r, e, "quantize", QUANT_FUNCS, "int4(group = 128, method = gptq)")
    if found is None:
        return None
    func, kw = found
    out: dict = {"bits": 8 if func == "int8" else 4, "group": 0 if func == "int8" else 128}
    if func == "int4" and "group" not in kw:  # 128, or the largest group that fits the model (kiln.quant.sizing)
        out["auto_group"] = True
    if "group" in kw:
        g = kw["group"]
        if isinstance(g, Num) and g.value in INT4_GROUPS:
            out["group"] = g.value
        else:
            r.error(g, f"group must be one of {', '.join(map(str, INT4_GROUPS))}, got {format_expr(g)}",
                    "weights share one scale per group of this many input features, e.g. group = 128")
            out = None
    if "method" in kw and out is not None:
        method = _enum(r, kw["method"], "method", "quantization method", ("rtn", "gptq"))
        out = out | {"method": method} if method else None
    if "calibration" in kw and out is not None:
        c = kw["calibration"]
        if isinstance(c, Str) and c.value:
            path = Path(c.value)
            if not path.is_absolute() and r.spec.path not in ("", "<spec>"):
                path = Path(r.spec.path).parent / path  # relative to the spec file, like any include
            out["calibration"] = str(path)
        else:
            r.error(c, f"calibration must be a file name in quotes, got {format_expr(c)}",
                    'e.g. calibration = "calib.txt" (a text file), or tokens = 512 for random tokens')
            out = None
    flags = ("tokens", "symmetric", "lm_head", "embeddings")
    vals = {k: _int(r, kw[k], k, 1 << 24, "tokens is a calibration token count: at most 16777216")
            if k == "tokens" else _bool(r, kw[k], k) for k in flags if k in kw}
    if out is None or None in vals.values():
        return None
    if out.get("method", "rtn") != "gptq":  # round-to-nearest reads neither: a silently unused setting is a trap
        for k in ("calibration", "tokens"):
            if k in kw:
                r.error(kw[k], f"{k} is read only by GPTQ calibration, and this quantize uses round-to-nearest "
                        f"(method = {out.get('method', 'rtn')}{'' if 'method' in kw else ', the default'})",
                        f"add method = gptq to calibrate, or remove {k}")
                return None
    return out | vals


def _pow2(r: _Report, e: Expr, name: str, lo: int, hi: int, why: str) -> int | None:
    if isinstance(e, Num) and type(e.value) is int and lo <= e.value <= hi and not e.value & (e.value - 1):
        return e.value
    r.error(e, f"{name} must be a power of two from {lo} to {hi}, got {format_expr(e)}", why)
    return None


def _kv_cache(r: _Report, e: Expr) -> dict | None:
    """`kv_cache = paged(block = 16, dtype = int8)` -> {"block": 16, "dtype": "int8"} (defaults 16, auto)."""
    found = _config_call(r, e, "kv_cache", {"paged": ("block", "dtype")}, "paged(block = 16)")
    if found is None:
        return None
    _, kw = found
    why = ("block is the tokens per KV cache block; a power of two keeps blocks aligned with the attention "
           "kernels' power-of-two key tiles (a tile covers whole blocks), e.g. block = 16")
    block = _pow2(r, kw["block"], "block", 1, KV_BLOCK_MAX, why) if "block" in kw else 16
    dtype = _enum(r, kw["dtype"], "dtype", "KV cache dtype", KV_DTYPES) if "dtype" in kw else "auto"
    return {"block": block, "dtype": dtype} if block is not None and dtype is not None else None


def _attention(r: _Report, e: Expr) -> dict | None:
    """`attention = reference | flash(tiles = auto) | flash(block_m = 64, block_n = 64, warps = 4, stages = 2)`
    -> {"kind": "reference"} or {"kind": "flash", "tile": None (chosen per shape) or the fixed tile's fields}."""
    funcs = {"flash": ("tiles", "block_m", "block_n", "warps", "stages"), "reference": ()}
    found = _config_call(r, e, "attention", funcs, "flash(tiles = auto)")
    if found is None:
        return None
    kind, kw = found
    if kind == "reference":
        return {"kind": kind}
    fixed = [k for k in funcs["flash"][1:] if k in kw]
    if "tiles" in kw and _enum(r, kw["tiles"], "tiles", "tiles choice", ("auto",)) is None:
        return None
    if not fixed:
        return {"kind": kind, "tile": None}
    if "tiles" in kw:
        r.error(kw[fixed[0]], f"tiles = auto and a fixed tile ({fixed[0]} = ...) contradict each other",
                "remove tiles = auto to pin the tile, or drop block_m / block_n / warps / stages to let kiln choose")
        return None
    missing = [k for k in ("block_m", "block_n") if k not in kw]
    for k in missing:
        r.error(e, f"a fixed flash tile needs `{k} = ...`", "e.g. flash(block_m = 64, block_n = 64, warps = 4)")
    why = "{} is the {} per tile: tl.dot needs at least 16 and Triton's tl.arange a power of two, e.g. {} = 64"
    tile = {
        "block_m": _pow2(r, kw["block_m"], "block_m", 16, 256, why.format("block_m", "query rows", "block_m"))
        if "block_m" in kw else None,
        "block_n": _pow2(r, kw["block_n"], "block_n", 16, 256, why.format("block_n", "keys", "block_n"))
        if "block_n" in kw else None,
        "num_warps": 4,
        "num_stages": 2,
    }
    if "warps" in kw:
        w = kw["warps"]
        ok = isinstance(w, Num) and w.value in TILE_WARPS and type(w.value) is int
        if not ok:
            r.error(w, f"warps must be one of {', '.join(map(str, TILE_WARPS))}, got {format_expr(w)}",
                    "warps per program; 4 suits 64x64 tiles, 8 bigger ones")
        tile["num_warps"] = w.value if ok else None
    if "stages" in kw:
        st = kw["stages"]
        ok = isinstance(st, Num) and type(st.value) is int and 1 <= st.value <= 8
        if not ok:
            r.error(st, f"stages must be an integer from 1 to 8, got {format_expr(st)}",
                    "stages is the software-pipelining depth of the key loop; 2 or 3 is usual")
        tile["num_stages"] = st.value if ok else None
    return {"kind": kind, "tile": tile} if not missing and None not in tile.values() else None


def compile_config(r: _Report, block: CompileBlock | None, model_layers: int | None = None) -> CompileConfig:
    """The compile block's settings; model_layers (the model's, when it resolved) bounds self(layers = L)."""
    if block is None:
        return CompileConfig()
    s = _unique(r, block.settings, "compile setting", COMPILE_KEYS, PLANNED_COMPILE_KEYS)
    dtype = _enum(r, s["dtype"].value, "dtype", "dtype", DTYPES) if "dtype" in s else "fp32"
    extra = {}
    if "quantize" in s:
        extra["quantize"] = _quantize(r, s["quantize"].value)
    if "kv_cache" in s:
        extra["kv_cache"] = _kv_cache(r, s["kv_cache"].value)
    if "attention" in s:
        extra["attention"] = _attention(r, s["attention"].value)
    if "speculation" in s:
        base = Path(r.spec.path).parent if r.spec.path not in ("", "<spec>") else None
        spec_cfg = speculation_value(r, s["speculation"].value, base_dir=base, model_layers=model_layers)
        if spec_cfg is not None:  # None: `off`, or an error already reported
            extra["speculation"] = spec_cfg
    return CompileConfig(dtype=dtype or "fp32", extra=extra)
