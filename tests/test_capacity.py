"""The capacity reconciliation (`nano models --capacity`): the published 8×H200 context claims from the real configs.

The budget per GPU is fitted to one published figure (Kimi K2.6's 686k BF16 tokens), so that row matches by
construction. What can fail: the fitted constant drifting from its fit, the other published figures straying from
what the fitted budget predicts, and the byte arithmetic against the architectures' published dimensions.
"""
import pytest

from nano.cli import capacity


@pytest.fixture(scope="module")
def rows() -> dict[tuple[str, str, str], capacity.Scenario]:
    return {(s.checkpoint.model, s.checkpoint.weights, s.kv_layout): s for s in capacity.scenarios()}


def test_the_budget_is_the_fit_of_kimis_bf16_figure():
    """BUDGET_GIB is the rounded solution of weights per GPU + 686,000 × 70,272 B; a preset change that moves the
    fit must refit the constant."""
    assert capacity.BUDGET_GIB == pytest.approx(capacity.fitted_budget_gib(), abs=0.005)
    assert "fitted" in capacity.inputs()["budget_source"]


def test_roles(rows):
    roles = {key: scenario.role for key, scenario in rows.items()}
    assert roles["kimi-k2.6", "INT4", "BF16"] == "fitted"
    nano_layout = "FP8, token scale (nano)"
    assert roles["kimi-k2.6", "INT4", nano_layout] == roles["glm-5.2", "INT4", nano_layout] == "nano"
    assert sum(role == "compared" for role in roles.values()) == 3


@pytest.mark.parametrize("key,published", [
    (("kimi-k2.6", "INT4", "FP8, tensor scale"), 1_372_000),
    (("glm-5.2", "INT4", "FP8 + indexer, 79 layers"), 1_180_000),
    (("glm-5.2", "FP8", "FP8 + indexer, 79 layers"), 500_000),
])
def test_the_fitted_budget_predicts_the_other_published_figures(rows, key, published):
    assert rows[key].tokens == pytest.approx(published, rel=0.01)


def test_kv_bytes_per_token(rows):
    # MLA caches a 512-value latent + a 64-value rope key per token per layer: 1152 B in BF16, 576 in FP8
    assert rows["kimi-k2.6", "INT4", "BF16"].kv_bytes_per_token == 61 * 1152 == 70_272
    assert rows["kimi-k2.6", "INT4", "FP8, tensor scale"].kv_bytes_per_token == 61 * 576 == 35_136
    assert rows["kimi-k2.6", "INT4", "FP8, token scale (nano)"].kv_bytes_per_token == 61 * (576 + 4)
    # GLM-5.2: + a 128-value FP8 indexer key with its fp32 scale, on 21 of 78 layers (every layer, MTP included,
    # in the published layout)
    assert rows["glm-5.2", "INT4", "FP8 + indexer, 79 layers"].kv_bytes_per_token == 79 * (576 + 132) == 55_932
    assert rows["glm-5.2", "INT4", "FP8, token scale (nano)"].kv_bytes_per_token == 78 * 580 + 21 * 132


def test_fp8_over_bf16_token_ratio():
    ratios = capacity.fp8_token_ratios(capacity.scenarios())
    assert ratios["per_tensor"] == pytest.approx(1152 / 576, abs=1e-4)      # B per token per layer
    assert ratios["nano"] == pytest.approx(1152 / 580, abs=1e-4)            # + nano's fp32 scale per token


def test_checkpoint_sizes_match_the_published_ones(rows):
    for scenario in rows.values():
        checkpoint = scenario.checkpoint
        assert checkpoint.nbytes / capacity.GIB == pytest.approx(checkpoint.published_gib, rel=0.01)


def test_the_printed_facts_come_from_the_configs():
    assert capacity.layout_facts() == {"kimi_values_per_token_layer": 512 + 64, "fp8_scale_bytes": 4,
                                       "glm_indexer_layers": 21, "glm_mtp_layers": 1}
