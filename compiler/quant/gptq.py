"""GPTQ (Frantar et al., 2022): calibrated weight quantization.

A weight is quantized column by column; each column's rounding error is folded into the columns not yet
quantized, weighted by the inverse Hessian H = 2 X^T X / n of the layer's inputs X, so the layer's output
error ||X W^T - X Q^T|| is what gets minimized rather than the weight error. Groups (int4) take their scale
and zero from the error-updated columns when the group starts, as the reference implementation does.

`calibrate` gets X by running the graph once over calibration tokens with an fx Interpreter: at every
selected kiln::linear it quantizes the weight from the inputs reaching it, then continues with the
dequantized weight, so later layers are calibrated on what the quantized model computes (sequential GPTQ in
a single forward pass).
"""

from __future__ import annotations

from pathlib import Path

import torch
import torch.nn.functional as F
from torch import fx

from kiln.errors import KilnError, PassError
from kiln.quant.formats import (
    QuantizedWeight,
    QuantScheme,
    check_shape,
    dequantize,
    fake_quant,
    group_params,
    store,
)
from kiln.tokenizer import ByteTokenizer

BLOCK = 128  # columns updated lazily as one block; a multiple of every int4 group, so groups never straddle
DAMP = 0.01  # H += DAMP * mean(diag(H)) * I: keeps the Cholesky factorization well defined


def calibration_ids(scheme: QuantScheme, vocab: int, tokenizer=None) -> torch.Tensor:
    """Token ids [rows, seq_len] for calibration: the scheme's text file (tokenized with `tokenizer`, else
    bytes) or seeded random tokens; at most scheme.tokens ids, cut into rows of scheme.seq_len."""
    if scheme.calibration:
        path = Path(scheme.calibration)
        if not path.is_file():
            raise KilnError(f"quantize: calibration file {path} does not exist; give a text file or use tokens = N")
        if tokenizer is None:
            tokenizer = ByteTokenizer(vocab)
        data = path.read_bytes()
        try:
            text = data.decode("utf-8")
        except UnicodeDecodeError as e:
            raise KilnError(f"quantize: calibration file {path} is not UTF-8 text (byte 0x{data[e.start]:02x} at "
                            f"offset {e.start}); give a UTF-8 text file (e.g. `iconv -t UTF-8`)") from None
        text = text.replace("\r\n", "\n").replace("\r", "\n")  # newlines as text mode (read_text) read them
        ids = torch.tensor(tokenizer.encode(text)[: scheme.tokens], dtype=torch.long)
        if ids.numel() == 0:
            raise KilnError(f"quantize: calibration file {path} has no text")
    else:
        gen = torch.Generator().manual_seed(scheme.seed)
        ids = torch.randint(0, vocab, (scheme.tokens,), generator=gen)
    rows = ids.numel() // scheme.seq_len
    return ids[None, :] if rows == 0 else ids[: rows * scheme.seq_len].view(rows, scheme.seq_len)


def hessian(x: torch.Tensor) -> torch.Tensor:
    """2 X^T X / n for inputs x [..., K], in fp32."""
    xr = x.reshape(-1, x.shape[-1]).float()
    return 2.0 * (xr.T @ xr) / max(xr.shape[0], 1)


def _inverse_factor(h: torch.Tensor) -> torch.Tensor:
    """Upper Cholesky factor of H^-1, adding damping until H is positive definite."""
    damp = DAMP * h.diagonal().mean().clamp(min=1e-8)
    eye = torch.eye(h.shape[0], dtype=h.dtype, device=h.device)
    for _ in range(6):
        lower, info = torch.linalg.cholesky_ex(h + damp * eye)
        if info.item() == 0:
            return torch.linalg.cholesky(torch.cholesky_inverse(lower), upper=True)
        damp = damp * 10
    raise KilnError("GPTQ: the calibration Hessian is not positive definite even with damping; use more tokens")


def gptq_quantize(w: torch.Tensor, h: torch.Tensor, scheme: QuantScheme, name: str = "weight") -> QuantizedWeight:
    """Quantize w [N, K] given the Hessian h [K, K] of its inputs; the stored form matches quantize_rtn's."""
    check_shape(name, tuple(w.shape), scheme)
    bits, sym = scheme.bits, scheme.symmetric
    W = w.float().clone()
    n, k = W.shape
    H = h.float().clone().to(W.device)
    dead = H.diagonal() == 0  # inputs that are always zero: their weights cannot matter
    H[dead, dead] = 1.0
    W[:, dead] = 0.0
    hinv = _inverse_factor(H)
    group = k if bits == 8 else scheme.group
    codes = torch.empty_like(W)
    scales = torch.empty(n, k // group, device=W.device)
    zeros = torch.empty_like(scales)
    if bits == 8:  # one scale per output channel, from the whole row
        s, z = group_params(W, bits, sym)
        scales[:, 0], zeros[:, 0] = s[:, 0], z[:, 0]
    for i1 in range(0, k, BLOCK):
        i2 = min(i1 + BLOCK, k)
        W1, err1, hinv1 = W[:, i1:i2].clone(), torch.zeros(n, i2 - i1, device=W.device), hinv[i1:i2, i1:i2]
        for i in range(i2 - i1):
            col = i1 + i
            g = col // group
            if bits == 4 and col % group == 0:
                s, z = group_params(W1[:, i : i + group], bits, sym)
                scales[:, g], zeros[:, g] = s[:, 0], z[:, 0]
            c, q = fake_quant(W1[:, i], scales[:, g], zeros[:, g], bits, sym)
            codes[:, col] = c
            err = (W1[:, i] - q) / hinv1[i, i]
            W1[:, i:] -= err[:, None] * hinv1[i, i:][None, :]
            err1[:, i] = err
        W[:, i2:] -= err1 @ hinv[i1:i2, i2:]
    return store(codes, scales, zeros, bits, group, sym)


class _Calibrator(fx.Interpreter):
    """Runs the graph; at each selected linear, quantizes its weight from its actual inputs (once per weight)."""

    def __init__(self, gm: fx.GraphModule, nodes: list[fx.Node], scheme: QuantScheme):
        super().__init__(gm)
        self.nodes, self.scheme = set(nodes), scheme
        self.results: dict[str, QuantizedWeight] = {}

    def run_node(self, n: fx.Node):
        if n not in self.nodes:
            return super().run_node(n)
        args, _ = self.fetch_args_kwargs_from_env(n)
        x, w, b = args[0], args[1], args[2] if len(args) > 2 else None
        target = str(n.args[1].target)
        if target not in self.results:
            self.results[target] = gptq_quantize(w, hessian(x), self.scheme, name=target)
        return F.linear(x, dequantize(self.results[target], x.dtype), b)


def calibrate(gm: fx.GraphModule, nodes: list[fx.Node], scheme: QuantScheme, ids: torch.Tensor) -> dict:
    """{weight name: QuantizedWeight} for the kiln::linear `nodes`, from one run over ids [B, T]."""
    names = [n.name for n in gm.graph.nodes if n.op == "placeholder"]
    if names != ["tokens", "positions"]:
        raise PassError(
            f"GPTQ calibration runs the whole-sequence graph (inputs tokens, positions), but this graph takes "
            f"{', '.join(names)}; run quantize before kv_cache, or save a quantized checkpoint and load it"
        )
    ref = next(iter(gm.parameters()))
    if ref.device.type == "meta":
        raise PassError("GPTQ needs real weights to calibrate, but the graph is on the meta device; quantize "
                        "round-to-nearest there (`method = rtn` in a spec, --quantize int4-rtn on the command line)")
    tokens = ids.to(ref.device)
    positions = torch.arange(tokens.shape[1], device=ref.device).expand_as(tokens).contiguous()
    runner = _Calibrator(gm, nodes, scheme)
    with torch.no_grad():
        runner.run(tokens, positions)
    return runner.results
