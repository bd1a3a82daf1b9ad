"""The bounds spec validation puts on sizes and values, and the size of a model they guard.

Sizes have upper bounds from what kiln can build (SIZE_LIMITS): head_dim from the attention kernels, the rest
far above any released model but low enough that shapes, kernel grids and compile time stay sane. On top of
them the whole model is refused above MAX_WEIGHT_BYTES of weights in its compile dtype: 1 TiB is more than
any single accelerator holds (the largest has 141 GB) and more than hosts kiln runs on have as RAM, so such a
spec could only fail later, after minutes of allocation. `kiln check` reports the size of every spec it accepts.
"""

from __future__ import annotations

import dataclasses

from kiln.model_config import ModelConfig, param_shapes

_BIG = "far above any released model; check the number"
SIZE_LIMITS = {  # key -> (largest value, why)
    "vocab": (1 << 24, _BIG), "dim": (1 << 17, _BIG), "layers": (1024, _BIG + " (layers also bound compile time)"),
    "heads": (1024, _BIG), "kv_heads": (1024, _BIG), "ffn": (1 << 20, _BIG), "context": (1 << 24, _BIG),
    "head_dim": (256, "the attention kernels take head_dim up to 256 (e.g. 64, 80, 96, 128, 256)"),
    "window": (1 << 24, "window is at most the largest context, 16777216"),
    "original": (1 << 24, "original is a context length: at most 16777216"),
}
FLOAT_LIMITS = {  # key -> (largest value, why): beyond these the fp32 arithmetic overflows or means nothing
    "eps": (1.0, "eps keeps the norm's division finite and is tiny, e.g. eps = 1e-5"),
    "theta": (1e12, "rope theta is a base wavelength, e.g. 10000 or 500000; larger ones overflow in fp32"),
    "factor": (1e6, "rope scaling factors are small ratios, e.g. factor = 8"),
}
MAX_WEIGHT_BYTES = 1 << 40  # 1 TiB; see the module docstring


def param_count(model: ModelConfig) -> int:
    """Parameters of the model, counted from one layer (the model itself may have up to 1024)."""
    def count(cfg: ModelConfig) -> int:
        total = 0
        for shape in param_shapes(cfg).values():
            n = 1
            for d in shape:
                n *= d
            total += n
        return total

    dense = dataclasses.replace(model, route=None)
    outside = count(dataclasses.replace(dense, layers=0))
    total = outside + model.layers * (count(dataclasses.replace(dense, layers=1)) - outside)
    if model.route is not None:  # a routed layer adds its router (and predictor) tensors
        every = model.route.every
        one = dataclasses.replace(model, layers=every)
        routed = sum(model.route.routed(i) for i in range(model.layers))
        total += routed * (count(one) - count(dataclasses.replace(dense, layers=every)))
    return total


def format_count(n: int) -> str:
    for div, unit in ((10**12, "T"), (10**9, "B"), (10**6, "M"), (10**3, "K")):
        if n >= div:
            return f"{n / div:.1f}{unit}"
    return str(n)


def format_bytes(n: int) -> str:
    for shift, unit in ((40, "TiB"), (30, "GiB"), (20, "MiB"), (10, "KiB")):
        if n >= 1 << shift:
            return f"{n / (1 << shift):.1f} {unit}"
    return f"{n} B"
