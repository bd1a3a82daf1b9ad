import torch

from tests.support.stats import chi_square_pvalue


def test_fair_draws_pass_and_biased_draws_fail():
    g = torch.Generator().manual_seed(0)
    p = torch.tensor([0.1, 0.2, 0.3, 0.4])
    fair = torch.bincount(torch.multinomial(p, 20000, replacement=True, generator=g), minlength=4)
    assert chi_square_pvalue(fair, p) > 1e-4
    biased = torch.bincount(torch.multinomial(torch.tensor([0.12, 0.2, 0.3, 0.38]), 20000, replacement=True,
                                              generator=g), minlength=4)
    assert chi_square_pvalue(biased, p) < 1e-4


def test_a_hit_on_an_impossible_token_fails():
    assert chi_square_pvalue([10, 5, 1], [0.6, 0.4, 0.0]) == 0.0
    assert chi_square_pvalue([10, 5, 0], [0.6, 0.4, 0.0]) > 0.0
