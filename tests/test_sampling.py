"""The sampler against an independent float64 reference of the truncated distribution."""
import numpy as np
import pytest
import torch

from nano.errors import NanoError
from nano.sampling import SamplingParams, sample


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
    draws = 20000
    counts = np.bincount([sample(logits[None], [params], [gen])[0] for _ in range(draws)], minlength=10)
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
])
def test_invalid_values_are_rejected(kwargs, message):
    with pytest.raises(NanoError, match=message):
        SamplingParams(**kwargs)
