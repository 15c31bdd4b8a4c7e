"""The capacity reconciliation: the published 8×H200 context claims follow from the real configs."""
import pytest

from cli import capacity


@pytest.fixture(scope="module")
def rows() -> dict[tuple[str, str, str], capacity.Scenario]:
    return {(s.checkpoint.model, s.checkpoint.weights, s.kv_layout): s for s in capacity.scenarios()}


@pytest.mark.parametrize("key,published", [
    (("kimi-k2.6", "INT4", "BF16"), 686_000),
    (("kimi-k2.6", "INT4", "FP8, tensor scale"), 1_372_000),
    (("glm-5.2", "INT4", "FP8 + indexer, 79 layers"), 1_180_000),
    (("glm-5.2", "FP8", "FP8 + indexer, 79 layers"), 500_000),
])
def test_headline_token_counts(rows, key, published):
    assert rows[key].published_tokens == published
    assert rows[key].tokens == pytest.approx(published, rel=0.01)


def test_kv_bytes_per_token(rows):
    assert rows["kimi-k2.6", "INT4", "BF16"].kv_bytes_per_token == 61 * 1152 == 70_272
    assert rows["kimi-k2.6", "INT4", "FP8, tensor scale"].kv_bytes_per_token == 61 * 576 == 35_136
    assert rows["kimi-k2.6", "INT4", "FP8, token scale (nano)"].kv_bytes_per_token == 61 * (576 + 4)
    assert rows["glm-5.2", "INT4", "FP8 + indexer, 79 layers"].kv_bytes_per_token == 79 * (576 + 132) == 55_932
    assert rows["glm-5.2", "INT4", "FP8, token scale (nano)"].kv_bytes_per_token == 78 * 580 + 21 * 132


def test_fp8_over_bf16_token_ratio():
    ratios = capacity.fp8_token_ratios(capacity.scenarios())
    assert ratios["per_tensor"] == pytest.approx(2.0, abs=1e-4)              # 1152 / 576 B per token per layer
    assert ratios["nano"] == pytest.approx(1152 / 580, abs=1e-4)             # + nano's fp32 scale per token
    assert round(ratios["nano"], 3) == 1.986


def test_checkpoint_sizes_match_the_published_ones(rows):
    for scenario in rows.values():
        checkpoint = scenario.checkpoint
        assert checkpoint.nbytes / capacity.GIB == pytest.approx(checkpoint.published_gib, rel=0.01)
    kimi = rows["kimi-k2.6", "INT4", "BF16"].checkpoint
    assert kimi.weights_per_gpu_bytes / capacity.GIB == pytest.approx(69.2, abs=0.05)


def test_budget_is_81_percent_of_an_h200():
    assert capacity.GPU_MEMORY_MIB / 1024 == pytest.approx(140.4, abs=0.01)
    assert capacity.inputs()["budget_fraction"] == pytest.approx(0.81, abs=0.005)
