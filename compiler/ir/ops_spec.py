"""kiln's speculative-decoding op: verify a batch of drafted tokens against the target (Level 2).

- kiln::spec_verify(target_probs, draft_tokens, draft_probs, num_drafts, uniforms, noise) -> (num_accepted, next)
  The modified rejection sampler (Leviathan et al. 2023; Chen et al. 2023), batched over rows; the fields are
  kiln.step.VerifyBatch's, which documents the semantics. Its output distribution is exactly the target's,
  whatever the drafter proposed: greedy rows (one-hot target_probs) accept a prefix match and continue with
  the target's argmax.

This reference is plain torch and vectorized over rows; the generated kernel (templates/spec_verify.py.j2) must
agree with it token for token on the same uniforms and noise.
"""

from __future__ import annotations

import torch

from kiln.ir.registry import kiln_op


@kiln_op("kiln::spec_verify", mutates_args=())
def spec_verify(target_probs: torch.Tensor, draft_tokens: torch.Tensor, draft_probs: torch.Tensor | None,
                num_drafts: torch.Tensor, uniforms: torch.Tensor, noise: torch.Tensor
                ) -> tuple[torch.Tensor, torch.Tensor]:
    p = target_probs.float()
    b, k1, v = p.shape
    k = k1 - 1
    rows = torch.arange(b, device=p.device)
    d = draft_tokens.long().clamp(0, v - 1)
    p_d = p[:, :k].gather(-1, d[..., None]).squeeze(-1)  # [B, K]: p_{j-1}(d_j)
    q_d = torch.ones_like(p_d) if draft_probs is None else draft_probs.float().gather(-1, d[..., None]).squeeze(-1)
    n = num_drafts.long().clamp(0, k)  # a count outside 0..K means "none" / "all K" (the kernel reads no further)
    valid = torch.arange(k, device=p.device)[None, :] < n[:, None]
    accept = (uniforms.float() * q_d < p_d) & valid  # u < p / q without dividing (q > 0 for a drafted token)
    num_accepted = accept.int().cumprod(-1).sum(-1) if k > 0 else torch.zeros(b, dtype=torch.int32, device=p.device)
    a = num_accepted.long()
    dist = p[rows, a]  # [B, V]: the bonus distribution, or the target's at the first rejection
    rejected = a < n
    if k > 0:
        a_k = a.clamp(max=k - 1)
        if draft_probs is None:
            q = torch.zeros_like(dist).scatter_(-1, d[rows, a_k][:, None], 1.0)
        else:
            q = draft_probs.float()[rows, a_k]
        residual = (dist - q).clamp(min=0)
        # p == q up to rounding leaves no residual mass; the rejection then had probability ~0: draw from p.
        residual = torch.where(residual.sum(-1, keepdim=True) > 0, residual, dist)
        dist = torch.where(rejected[:, None], residual, dist)
    next_token = (dist / noise.float()).argmax(-1)
    return num_accepted.to(torch.int32), next_token


@spec_verify.register_fake
def _(target_probs, draft_tokens, draft_probs, num_drafts, uniforms, noise):
    b = target_probs.shape[0]
    return (target_probs.new_empty(b, dtype=torch.int32), target_probs.new_empty(b, dtype=torch.int64))
