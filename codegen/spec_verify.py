"""Host wrapper for speculative decoding's verification kernel (templates/spec_verify.py.j2).

`spec_verify` has kiln::spec_verify's signature (kiln.ir.ops_spec; kiln.step.VerifyBatch documents the fields) and
returns the same (num_accepted int32 [B], next_token int64 [B]), token for token on the same uniforms and noise.
One program per row walks that row's drafts, then draws its next token in one pass over the vocabulary in tiles of
BLOCK_V. Deterministic drafters (draft_probs None) get the HAS_DRAFT_PROBS=False instance, which reads no q.
"""

from __future__ import annotations

import torch

from kiln.codegen._host import check_same_device, check_tensor, launch, next_power_of_2
from kiln.errors import CodegenError

_INDEX = (torch.int32, torch.int64)
_FP32 = (torch.float32,)
MAX_BLOCK_V = 4096  # one tile of fp32 p, q and noise per loop step: 48 KiB of loads in flight per program


def default_block_v(vocab: int) -> int:
    return min(next_power_of_2(max(vocab, 1)), MAX_BLOCK_V)


def _check_shape(t: torch.Tensor, name: str, want: tuple[int, ...], what: str) -> None:
    if tuple(t.shape) != want:
        raise CodegenError(f"{name} has shape {tuple(t.shape)}; expected {list(want)} ({what})")


def _out(t: torch.Tensor | None, name: str, b: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    if t is None:
        return torch.empty(b, dtype=dtype, device=device)
    if not isinstance(t, torch.Tensor) or t.shape != (b,) or t.dtype != dtype or t.device != device:
        got = f"{t.dtype} {tuple(t.shape)} on {t.device}" if isinstance(t, torch.Tensor) else type(t).__name__
        raise CodegenError(f"{name} must be a {dtype} tensor of shape [{b}] on {device}, got {got}")
    _contiguous(t, name)
    return t


def _contiguous(t: torch.Tensor, name: str) -> None:
    if not t.is_contiguous():
        raise CodegenError(f"{name} must be contiguous (strides {t.stride()}); call .contiguous()")


def spec_verify(
    target_probs: torch.Tensor,
    draft_tokens: torch.Tensor,
    draft_probs: torch.Tensor | None,
    num_drafts: torch.Tensor,
    uniforms: torch.Tensor,
    noise: torch.Tensor,
    *,
    block_v: int | None = None,
    num_accepted: torch.Tensor | None = None,
    next_token: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """kiln::spec_verify: target_probs fp32 [B, K + 1, V], draft_tokens int [B, K], draft_probs fp32 [B, K, V] or
    None (one-hot drafts), num_drafts int [B], uniforms fp32 [B, K], noise fp32 [B, V] (Exp(1) draws) ->
    (num_accepted int32 [B], next_token int64 [B]). block_v: the vocabulary tile (a power of two; default
    default_block_v(V)); num_accepted / next_token: outputs to write instead of new tensors."""
    check_tensor(target_probs, "target_probs", ndim=3, dtypes=_FP32)
    b, k1, v = target_probs.shape
    k = k1 - 1
    if k < 0 or v < 1:
        raise CodegenError(f"target_probs has shape {tuple(target_probs.shape)}; expected [B, K + 1, V] with V >= 1 "
                           "(one distribution per draft plus the bonus position)")
    check_tensor(draft_tokens, "draft_tokens", ndim=2, dtypes=_INDEX, unit_last_stride=False)
    _check_shape(draft_tokens, "draft_tokens", (b, k), "[B, K] for target_probs [B, K + 1, V]")
    if draft_probs is not None:
        check_tensor(draft_probs, "draft_probs", ndim=3, dtypes=_FP32)
        _check_shape(draft_probs, "draft_probs", (b, k, v), "[B, K, V]; pass None for deterministic drafts")
    check_tensor(num_drafts, "num_drafts", ndim=1, dtypes=_INDEX, unit_last_stride=False)
    _check_shape(num_drafts, "num_drafts", (b,), "one count per row")
    _contiguous(num_drafts, "num_drafts")
    check_tensor(uniforms, "uniforms", ndim=2, dtypes=_FP32, unit_last_stride=False)
    _check_shape(uniforms, "uniforms", (b, k), "one U[0, 1) draw per draft")
    check_tensor(noise, "noise", ndim=2, dtypes=_FP32)
    _check_shape(noise, "noise", (b, v), "one Exp(1) draw per row and vocabulary entry")
    check_same_device(target_probs=target_probs, draft_tokens=draft_tokens, draft_probs=draft_probs,
                      num_drafts=num_drafts, uniforms=uniforms, noise=noise)  # fmt: skip
    block_v = default_block_v(v) if block_v is None else block_v
    if block_v < 1 or block_v & (block_v - 1):
        raise CodegenError(f"block_v={block_v} must be a power of two (tl.arange needs one)")
    device = target_probs.device
    num_accepted = _out(num_accepted, "num_accepted", b, torch.int32, device)
    next_token = _out(next_token, "next_token", b, torch.int64, device)
    if b == 0:
        return num_accepted, next_token
    q = draft_probs if draft_probs is not None else target_probs  # a pointer HAS_DRAFT_PROBS=False never reads
    args = {
        "target_probs_ptr": target_probs, "draft_tokens_ptr": draft_tokens, "draft_probs_ptr": q,
        "num_drafts_ptr": num_drafts, "uniforms_ptr": uniforms, "noise_ptr": noise,
        "num_accepted_ptr": num_accepted, "next_token_ptr": next_token,
        "stride_p_b": target_probs.stride(0), "stride_p_k": target_probs.stride(1),
        "stride_d_b": draft_tokens.stride(0), "stride_d_k": draft_tokens.stride(1),
        "stride_q_b": q.stride(0) if draft_probs is not None else 0,
        "stride_q_k": q.stride(1) if draft_probs is not None else 0,
        "stride_u_b": uniforms.stride(0), "stride_u_k": uniforms.stride(1), "stride_n_b": noise.stride(0),
        "K": k, "V": v,
    }  # fmt: skip
    consts = {"BLOCK_V": block_v, "HAS_DRAFT_PROBS": draft_probs is not None}
    launch("spec_verify", "spec_verify", (b,), args, consts, {"num_warps": 4 if block_v <= 2048 else 8})
    return num_accepted, next_token
