"""Weight quantization math: schemes, quantize / dequantize, int4 packing.

Stored forms (what the quantized-linear ops and kernels read; layout version LAYOUT_VERSION = 2):
- int8 (W8A16): qweight int8 [N, K] symmetric per output channel, w = q * scales[n]; scales fp32 [N]. With 2-D
  scales fp32 [N, K / G] the scale is per group of G along K (GGUF's Q8_0, G = 32, kept as stored). Row-major,
  contiguous in K for each output row (the GEMV streams each row with 16-byte loads).
- int4: qweight uint8 [N, K / 2], two codes per byte, in blocks of 32 along K (32 divides every group): byte j
  (0..15) of block b holds element 32 b + j in its low nibble and element 32 b + 16 + j in its high nibble. This is
  GGML's Q4_0 / Q4_1 block order, so a GGUF's blocks are kept byte for byte, and it lets a kernel unpack 16
  bytes into two runs of 16 consecutive k whose activations are contiguous too (layout version 1 paired
  neighbours, k = 2i low and 2i + 1 high, which made every activation load a stride-2 gather; `repack_int4_v1`
  converts). scales fp32 [N, K / G]; w = (q - z) * scales[n, k // G] with z = zeros[n, k // G] (uint8
  [N, K / G]) when asymmetric, and z = 8 when symmetric (codes are the signed value + 8, so no zeros tensor is
  stored). A float `zeros` (fp32 [N, K / G]) is instead a per-group minimum: w = q * scales[n, k // G] +
  zeros[n, k // G] (GGUF's Q4_1, kept as stored).
Scales stay fp32 whatever the model dtype: a bf16 scale would add a per-row error as large as int8's own.

One fake-quant rule (`fake_quant`) serves round-to-nearest and GPTQ, so both produce the same stored form.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, fields, replace

import torch

from kiln.errors import KilnError
from kiln.model_config import INT4_GROUPS
from kiln.quant.sizing import scheme_label

METHODS = ("rtn", "gptq")
LAYOUT_VERSION = 2  # the int4 packing above; 1 = neighbouring k paired in a byte (repack_int4_v1 converts)
INT4_BLOCK = 32  # int4 codes are packed in blocks of this many k (see the module docstring)


@dataclass(frozen=True)
class QuantScheme:
    """What to quantize and how. group 0 means per output channel (int8 only)."""

    bits: int = 8  # 8 or 4
    group: int = 0  # int4: 32 / 64 / 128
    symmetric: bool = True
    method: str = "rtn"  # rtn (round to nearest) | gptq (calibrated)
    calibration: str | None = None  # a text file of calibration text; None = seeded random tokens
    tokens: int = 512  # calibration tokens
    seq_len: int = 128  # calibration sequence length
    lm_head: bool = False
    embeddings: bool = False
    seed: int = 0
    # int4 named without a group (`int4`, `int4-gptq`, a spec's `quantize = int4`): group 128 where it divides every
    # quantized K, else the largest of 64 / 32 that does; kiln.quant.sizing.resolve_group fixes it per model.
    auto_group: bool = False

    def __post_init__(self) -> None:
        if self.bits not in (4, 8):
            raise KilnError(f"quantize: bits must be 8 or 4, got {self.bits}")
        if self.bits == 8 and (self.group != 0 or not self.symmetric):
            raise KilnError("quantize: int8 is per output channel and symmetric; drop group / symmetric = false")
        if self.bits == 4 and self.group not in INT4_GROUPS:
            raise KilnError(f"quantize: int4 group must be one of {INT4_GROUPS}, got {self.group}")
        if self.method not in METHODS:
            raise KilnError(f"quantize: method must be one of {METHODS}, got {self.method!r}")
        if self.tokens < 1 or self.seq_len < 1:
            raise KilnError("quantize: tokens and seq_len must be at least 1")

    @property
    def label(self) -> str:
        """A short name: int8, int8-gptq, int4-rtn-g128, int4-gptq-g64-asym."""
        return scheme_label(self.bits, self.method, self.group, self.symmetric)

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> QuantScheme:
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(d) - known)
        if unknown:
            raise KilnError(f"quantize: unknown option(s) {', '.join(unknown)}; known: {', '.join(sorted(known))}")
        return cls(**d)


def parse_scheme(text: str, **overrides) -> QuantScheme:
    """A scheme from a short name (CLI --quantize): int8, int4, int4-g64, int4-gptq, int4-gptq-g128-asym, ..."""
    parts = text.strip().lower().split("-")
    head, opts = parts[0], parts[1:]
    if head == "gguf":  # the GGUF loader takes it (keep a GGUF's quantized linears); anywhere else it means nothing
        raise KilnError(f"quantize {text!r} (--quantize) keeps a GGUF file's quantized linears: it needs GGUF weights "
                        "(--weights FILE.gguf); to quantize these weights use int8 or "
                        "int4[-rtn|-gptq][-g32|-g64|-g128][-asym]")
    if head not in ("int8", "int4"):
        raise KilnError(f"quantize {text!r} (--quantize): expected int8 or int4[-rtn|-gptq][-g32|-g64|-g128][-asym]")
    scheme = QuantScheme(bits=8) if head == "int8" else QuantScheme(bits=4, group=128, auto_group=True)
    for opt in opts:
        if opt in METHODS:
            scheme = replace(scheme, method=opt)
        elif opt == "asym":
            scheme = replace(scheme, symmetric=False)
        elif opt.startswith("g") and opt[1:].isdigit():
            scheme = replace(scheme, group=int(opt[1:]), auto_group=False)
        else:
            raise KilnError(f"quantize {text!r} (--quantize): unknown part {opt!r} (rtn, gptq, g32, g64, g128, asym)")
    return replace(scheme, **overrides)


# What a --quantize name (LLM's quantize=) sets over a spec's own `quantize`: the format and the method. The spec's
# other options stay, since the name cannot say them: what it quantizes (lm_head, embeddings) and, when the result
# calibrates (GPTQ), on what (calibration, tokens, seq_len, seed).
_KEPT = ("lm_head", "embeddings")
_KEPT_GPTQ = ("calibration", "tokens", "seq_len", "seed")


def override_scheme(spec: QuantScheme | dict | str | None, flag: QuantScheme | str) -> QuantScheme:
    """The scheme a --quantize name `flag` gives over the spec's `quantize` (None: it has none): the flag's bits,
    group, symmetry and method, with the spec's lm_head / embeddings and, for a GPTQ result, its calibration."""
    flag = as_scheme(flag)
    if spec is None:
        return flag
    spec = as_scheme(spec)
    kept = _KEPT + (_KEPT_GPTQ if flag.method == "gptq" else ())
    return replace(flag, **{f: getattr(spec, f) for f in kept})


def kept_from_spec(scheme: QuantScheme) -> list[str]:
    """The options override_scheme kept from a spec that differ from a bare name's defaults, as `key = value` (what a
    note says the flag did not replace)."""
    default = QuantScheme()
    kept = _KEPT + (_KEPT_GPTQ if scheme.method == "gptq" else ())
    return [f"{f} = {_spec_value(getattr(scheme, f))}" for f in kept if getattr(scheme, f) != getattr(default, f)]


def _spec_value(v: object) -> str:
    return ("true" if v else "false") if isinstance(v, bool) else f'"{v}"' if isinstance(v, str) else str(v)


def as_scheme(value: QuantScheme | dict | str) -> QuantScheme:
    if isinstance(value, QuantScheme):
        return value
    if isinstance(value, str):
        return parse_scheme(value)
    return QuantScheme.from_dict(dict(value))


@dataclass
class QuantizedWeight:
    """One quantized [N, K] matrix in its stored form (see the module docstring)."""

    qweight: torch.Tensor
    scales: torch.Tensor
    zeros: torch.Tensor | None
    bits: int
    group: int  # 0 for int8 per channel

    @property
    def shape(self) -> tuple[int, int]:
        n, k = self.qweight.shape
        return (n, k * 2 if self.bits == 4 else k)


# ---- the fake-quant rule ----------------------------------------------------------------------------------


def qrange(bits: int, symmetric: bool) -> tuple[int, int]:
    """Integer code range: signed for symmetric (int8 uses +-127 so the range is symmetric), unsigned otherwise."""
    if symmetric:
        return (-127, 127) if bits == 8 else (-8, 7)
    return 0, 2**bits - 1


def group_params(w: torch.Tensor, bits: int, symmetric: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """(scale, zero) [N, 1] for the rows of w [N, G] (one group each); zero is 0 when symmetric."""
    w = w.float()
    if symmetric:
        scale = w.abs().amax(dim=1, keepdim=True) / qrange(bits, True)[1]
        scale = torch.where(scale > 0, scale, torch.ones_like(scale))
        return scale, torch.zeros_like(scale)
    qmax = 2**bits - 1
    lo, hi = w.amin(dim=1, keepdim=True).clamp(max=0), w.amax(dim=1, keepdim=True).clamp(min=0)
    scale = (hi - lo) / qmax
    scale = torch.where(scale > 0, scale, torch.ones_like(scale))
    return scale, torch.round(-lo / scale).clamp(0, qmax)


def fake_quant(
    w: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, bits: int, symmetric: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """(integer codes, dequantized values) of w under (scale, zero); shapes broadcast."""
    lo, hi = qrange(bits, symmetric)
    codes = torch.clamp(torch.round(w.float() / scale) + zero, lo, hi)
    return codes, (codes - zero) * scale


# ---- stored form ------------------------------------------------------------------------------------------


def pack_int4(codes: torch.Tensor) -> torch.Tensor:
    """uint8 [..., K / 2] from codes in 0..15 [..., K] (K a multiple of 32): per block of 32, byte j = element j
    (low nibble) | element j + 16 (high nibble)."""
    lead, k = codes.shape[:-1], codes.shape[-1]
    if k % INT4_BLOCK:
        raise KilnError(f"int4 packing needs K a multiple of {INT4_BLOCK}, got K = {k}")
    c = codes.to(torch.uint8).reshape(*lead, k // INT4_BLOCK, 2, INT4_BLOCK // 2)
    return (c[..., 0, :] | (c[..., 1, :] << 4)).reshape(*lead, k // 2)


def unpack_int4(packed: torch.Tensor) -> torch.Tensor:
    """Codes 0..15 uint8 [..., K] from packed [..., K / 2] (the inverse of pack_int4)."""
    lead, half = packed.shape[:-1], packed.shape[-1]
    p = packed.reshape(*lead, half // (INT4_BLOCK // 2), 1, INT4_BLOCK // 2)
    return torch.cat((p & 0xF, p >> 4), dim=-2).reshape(*lead, half * 2)


def repack_int4_v1(packed: torch.Tensor) -> torch.Tensor:
    """A layout-version-1 int4 qweight (byte i = k 2i low | k 2i + 1 high) in the current layout; same codes."""
    lead = packed.shape[:-1]
    codes = torch.stack((packed & 0xF, packed >> 4), dim=-1).reshape(*lead, -1)
    return pack_int4(codes)


def store(codes: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, bits: int, group: int, symmetric: bool):
    """QuantizedWeight from integer codes [N, K] and per-group scales / zeros [N, K / G] (int8: [N, 1])."""
    if bits == 8:
        return QuantizedWeight(codes.to(torch.int8), scales.reshape(-1).float().contiguous(), None, 8, 0)
    if symmetric:
        return QuantizedWeight(pack_int4(codes + 8), scales.float().contiguous(), None, 4, group)
    return QuantizedWeight(pack_int4(codes), scales.float().contiguous(), zeros.to(torch.uint8), 4, group)


def check_shape(name: str, shape: tuple[int, ...], scheme: QuantScheme) -> None:
    """KilnError unless a [N, K] weight can take the scheme (K a multiple of the group)."""
    if len(shape) != 2:
        raise KilnError(f"cannot quantize {name}: expected a 2-D weight, got shape {list(shape)}")
    k = shape[1]
    fitting = [g for g in INT4_GROUPS if k % g == 0]
    if scheme.bits == 4 and not fitting:  # a plain `int4` lands here with group 128 it never asked for
        raise KilnError(
            f"cannot quantize {name} to int4: its K = {k} is not a multiple of {min(INT4_GROUPS)}, the smallest "
            f"int4 group ({', '.join(map(str, INT4_GROUPS))}), so no int4 group fits; use int8"
        )
    if scheme.bits == 4 and k % scheme.group:
        raise KilnError(
            f"cannot quantize {name} to int4 with group {scheme.group}: its K = {k} is not a multiple of "
            f"{scheme.group}; pick a group that divides {k} ({' or '.join(map(str, fitting))}) or use int8"
        )


def quantize_rtn(w: torch.Tensor, scheme: QuantScheme) -> QuantizedWeight:
    """Round-to-nearest quantization of w [N, K] (any float dtype, any device, meta included)."""
    check_shape("weight", tuple(w.shape), scheme)
    n, k = w.shape
    group = k if scheme.bits == 8 else scheme.group
    wg = w.float().reshape(n * (k // group), group)
    scale, zero = group_params(wg, scheme.bits, scheme.symmetric)
    codes, _ = fake_quant(wg, scale, zero, scheme.bits, scheme.symmetric)
    shaped = (n, k // group)
    return store(codes.reshape(n, k), scale.reshape(shaped), zero.reshape(shaped), scheme.bits, group, scheme.symmetric)


def dequantize(qw: QuantizedWeight, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The [N, K] matrix a QuantizedWeight stands for."""
    return dequantize_parts(qw.qweight, qw.scales, qw.zeros, qw.bits, qw.group).to(dtype)


def dequantize_parts(
    qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor | None, bits: int, group: int
) -> torch.Tensor:
    """fp32 weights from the stored tensors; works on any leading rows (gathered embedding rows included)."""
    lead = qweight.shape[:-1]
    if bits == 8:
        if scales.dim() == qweight.dim():  # per-group scales [..., K / G] (GGUF's Q8_0 kept as stored)
            g = qweight.shape[-1] // scales.shape[-1]
            return (qweight.float().reshape(*lead, scales.shape[-1], g) * scales.float()[..., None]).reshape(*lead, -1)
        return qweight.float() * scales.float()[..., None]
    codes = unpack_int4(qweight).float().reshape(*lead, scales.shape[-1], group)
    if zeros is not None and zeros.is_floating_point():  # a float minimum per group (GGUF Q4_1): w = q * s + m
        return (codes * scales.float()[..., None] + zeros.float()[..., None]).reshape(*lead, -1)
    z = zeros.float() if zeros is not None else torch.full_like(scales, 8.0, dtype=torch.float32)
    return ((codes - z[..., None]) * scales.float()[..., None]).reshape(*lead, -1)


def stored_bytes(qw: QuantizedWeight) -> int:
    return sum(t.numel() * t.element_size() for t in (qw.qweight, qw.scales, qw.zeros) if t is not None)
