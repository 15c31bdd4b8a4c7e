"""The sampler against an independent float64 reference of the truncated distribution."""
import numpy as np
import pytest
import torch

from nano.errors import NanoError
from nano.sampling import MIN_TEMPERATURE, SamplingParams, distribution, sample


def reference_distribution(logits: np.ndarray, temperature: float, top_k: int, top_p: float) -> np.ndarray:
    """Temperature, then top-k, then the smallest top set reaching top_p, renormalised (float64)."""
    z = logits.astype(np.float64) / temperature
    order = np.argsort(-z)
    keep = np.zeros_like(z, dtype=bool)
    keep[order[: top_k or len(z)]] = True
    p = np.exp(z - z.max()) * keep
    p /= p.sum()
    mass = 0.0
    for i in order:
        if not keep[i]:
            continue
        if mass >= top_p:
            keep[i] = False
        mass += p[i]
    p = p * keep
    return p / p.sum()


@pytest.mark.parametrize("temperature,top_k,top_p", [(1.0, 0, 1.0), (0.7, 5, 1.0), (1.3, 0, 0.8), (1.0, 4, 0.6)])
def test_sampled_frequencies_match_reference(temperature, top_k, top_p):
    logits = torch.tensor([2.0, 1.5, 1.0, 0.8, 0.3, 0.0, -0.5, -1.0, -2.0, -3.0])
    params = SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p)
    gen = torch.Generator().manual_seed(0)
    draws = 20000   # one batch of identical rows sharing the generator: the same draws as one row at a time
    counts = np.bincount(sample(logits.expand(draws, -1), [params] * draws, [gen] * draws), minlength=10)
    expected = reference_distribution(logits.numpy(), temperature, top_k, top_p)
    assert np.all(counts[expected == 0] == 0), "a truncated token was sampled"
    np.testing.assert_allclose(counts / draws, expected, atol=0.015)


def test_greedy_takes_argmax_per_row_and_seeds_are_per_request():
    logits = torch.tensor([[0.1, 3.0, 0.2], [5.0, 0.0, 0.0]])
    greedy = SamplingParams(temperature=0)
    assert sample(logits, [greedy, greedy], [torch.Generator(), torch.Generator()]) == [1, 0]
    hot = SamplingParams(temperature=2.0)
    row = torch.randn(1, 50)
    a = [sample(row, [hot], [g])[0] for g in [torch.Generator().manual_seed(7)] * 20]
    b = [sample(row, [hot], [g])[0] for g in [torch.Generator().manual_seed(7)] * 20]
    assert a == b


@pytest.mark.parametrize("kwargs,message", [
    (dict(temperature=-0.1), "temperature"), (dict(temperature=float("nan")), "temperature"),
    (dict(top_p=0.0), "top_p"), (dict(top_p=1.5), "top_p"), (dict(top_k=-1), "top_k"),
    (dict(max_tokens=0), "max_tokens"), (dict(seed=-3), "seed"), (dict(stop_token_ids=[-1]), "stop_token_ids"),
    # values the sampler or the generator could not take (reliability report N1): refused, not raised later
    (dict(temperature=1e-38), "temperature"), (dict(temperature=5e-324), "temperature"),
    (dict(temperature=MIN_TEMPERATURE / 2), "temperature"), (dict(top_p=float("nan")), "top_p"),
    (dict(seed=2**64), "seed"),
])
def test_invalid_values_are_rejected(kwargs, message):
    with pytest.raises(NanoError, match=message):
        SamplingParams(**kwargs)


def test_the_limits_themselves_are_accepted_and_the_generator_takes_the_seed():
    assert SamplingParams(temperature=MIN_TEMPERATURE, top_p=1e-300).temperature == 1e-5
    torch.Generator().manual_seed(SamplingParams(seed=2**64 - 1).seed)


LOGITS = [2.0, 1.5, 1.0, 0.8, 0.3, 0.0, -0.5, -1.0, -2.0, -3.0]


@pytest.mark.parametrize("logits,temperature,top_k,top_p", [
    (LOGITS, 1.0, 0, 1.0), (LOGITS, 0.7, 5, 1.0), (LOGITS, 1.3, 0, 0.8), (LOGITS, 1.0, 4, 0.6),
    ([2.0, 1.99999, 1.99998, 0.0], MIN_TEMPERATURE, 0, 1.0),   # logits 1e-5 apart: still a spread at 1e-5
    (LOGITS, MIN_TEMPERATURE, 0, 1.0),                           # logits / T far past the top: one-hot
    (LOGITS, 1.0, 0, 1e-300),                                    # top_p is 0 in float32: the top token stays
    ([3e38, 2.9e38, -3e38, 0.0], 0.5, 0, 1.0),                   # logits / T overflows float32
    ([1e4, 1e4 - 3, 1e4 - 5, -1e4], 2.0, 2, 0.9),
    (LOGITS, 10**30, 0, 1.0),                                    # an int past int64 (JSON gives ints): uniform
])
def test_distribution_matches_a_float64_reference_at_the_extremes(logits, temperature, top_k, top_p):
    """The weights the sampler draws from (float32) against the float64 reference, at the extremes validation lets
    through: nothing overflows to inf or nan, and a truncated token gets exactly 0."""
    row = torch.tensor(logits)
    params = SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p)
    got = distribution(row, params).double().numpy()
    got /= got.sum()   # multinomial takes weights: the cut leaves them unnormalised
    expected = reference_distribution(row.numpy(), temperature, top_k, top_p)
    assert np.all(got[expected == 0] == 0)
    np.testing.assert_allclose(got, expected, atol=1e-6)


@pytest.mark.parametrize("temperature,top_p", [(MIN_TEMPERATURE, 1.0), (1.0, 1e-300), (0.5, 1e-45)])
def test_a_tiny_temperature_or_top_p_draws_the_argmax(temperature, top_p):
    logits = torch.randn(8, 300, generator=torch.Generator().manual_seed(2)) * 3
    params = SamplingParams(temperature=temperature, top_p=top_p)
    tokens = sample(logits, [params] * 8, [torch.Generator().manual_seed(i) for i in range(8)])
    assert tokens == logits.argmax(-1).tolist()


def test_a_failed_draw_is_that_rows_result_and_the_others_keep_theirs(monkeypatch):
    logits = torch.randn(3, 50, generator=torch.Generator().manual_seed(4))
    params = [SamplingParams(temperature=0.9, seed=i) for i in range(3)]
    generators = lambda: [torch.Generator().manual_seed(i) for i in range(3)]
    want = sample(logits, params, generators())
    gens, draw = generators(), torch.multinomial

    def failing(probs, n, generator=None):
        if generator is gens[1]:
            raise RuntimeError("invalid multinomial distribution")
        return draw(probs, n, generator=generator)

    monkeypatch.setattr(torch, "multinomial", failing)
    got = sample(logits, params, gens)
    assert isinstance(got[1], RuntimeError) and [got[0], got[2]] == [want[0], want[2]]


def test_seeded_keeps_a_set_seed_and_draws_a_fresh_one_otherwise():
    """`seeded()` (nano chat, nano serve): a set seed stays (a reply is repeatable); none becomes a seed in the range
    SamplingParams accepts, another for each reply, the other settings unchanged."""
    fixed = SamplingParams(temperature=0.7, top_k=5, seed=2**64 - 1, max_tokens=9)
    assert fixed.seeded() == fixed
    unseeded = SamplingParams(temperature=0.7, top_k=5, max_tokens=9, stop_token_ids=[3])
    drawn = [unseeded.seeded() for _ in range(3)]
    assert len({p.seed for p in drawn}) == 3                                   # 64 random bits each
    assert all(p == SamplingParams(**{**vars(unseeded), "seed": p.seed}) for p in drawn)
    assert unseeded.seed is None                                               # the params themselves stay unseeded
