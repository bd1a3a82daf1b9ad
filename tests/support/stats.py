"""Goodness-of-fit for sampling tests: Pearson's chi-square against known probabilities.

Cells with a small expected count are pooled (the chi-square approximation needs about 5 per cell); a cell with
probability 0 that was hit fails outright, since no false alarm can produce it.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch


def chi_square_pvalue(counts: Sequence[int] | torch.Tensor, probs: Sequence[float] | torch.Tensor,
                      min_expected: float = 5.0) -> float:
    """The p-value of observing `counts` if draws follow `probs` (1-D, same length; probs need not be normalized)."""
    obs = torch.as_tensor(counts, dtype=torch.float64).flatten()
    p = torch.as_tensor(probs, dtype=torch.float64).flatten()
    assert obs.shape == p.shape, f"{obs.shape} counts for {p.shape} probabilities"
    p = p / p.sum()
    n = float(obs.sum())
    if bool(((p == 0) & (obs > 0)).any()):
        return 0.0
    expected = p * n
    order = torch.argsort(expected)
    pooled_obs, pooled_exp, acc_o, acc_e = [], [], 0.0, 0.0
    for i in order.tolist():  # pool the smallest cells until each pooled cell expects enough draws
        if expected[i] == 0:
            continue
        acc_o, acc_e = acc_o + float(obs[i]), acc_e + float(expected[i])
        if acc_e >= min_expected:
            pooled_obs.append(acc_o)
            pooled_exp.append(acc_e)
            acc_o = acc_e = 0.0
    if acc_e > 0:  # the leftover joins the last pooled cell
        if pooled_exp:
            pooled_obs[-1] += acc_o
            pooled_exp[-1] += acc_e
        else:
            pooled_obs, pooled_exp = [acc_o], [acc_e]
    dof = len(pooled_exp) - 1
    if dof < 1:
        return 1.0
    o, e = torch.tensor(pooled_obs, dtype=torch.float64), torch.tensor(pooled_exp, dtype=torch.float64)
    stat = float(((o - e) ** 2 / e).sum())
    # P(chi2_dof > stat) = Q(dof / 2, stat / 2), the regularized upper incomplete gamma function.
    return float(torch.special.gammaincc(torch.tensor(dof / 2, dtype=torch.float64),
                                         torch.tensor(stat / 2, dtype=torch.float64)))
