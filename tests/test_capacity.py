"""The capacity reconciliation (`nano models --capacity`): the published 8×H200 context claims from the real configs.

The budget per GPU is fitted to one published figure (Kimi K2.6's 686k BF16 tokens), so that row matches by
construction. What can fail: the fitted constant drifting from its fit, the other published figures straying from
what the fitted budget predicts, and the byte arithmetic against the architectures' published dimensions.

`--capacity --tp N`, the per-GPU plan under nano's tensor / expert parallelism, is checked against nano's own model:
its parameter shapes on the meta device, whole and as nano/parallel.py's `shard` cuts them, and the identity
Σ ranks = the single device + (N-1) × the replicated parts.
"""
import dataclasses
import json
import re
from types import SimpleNamespace

import pytest
import torch

from nano.cli import capacity
from nano.config import ModelConfig
from nano.presets import PRESETS
from tests.fixtures import assert_user_error, nano


@pytest.fixture(scope="module")
def rows() -> dict[tuple[str, str, str], capacity.Scenario]:
    """By checkpoint and the table's name of the cache (unique per checkpoint)."""
    return {(s.checkpoint.model, s.checkpoint.weights, s.label): s for s in capacity.scenarios()}


def test_the_budget_is_the_fit_of_kimis_bf16_figure():
    """BUDGET_GIB is the rounded solution of weights per GPU + 686,000 × 70,272 B; a preset change that moves the
    fit must refit the constant."""
    assert capacity.BUDGET_GIB == pytest.approx(capacity.fitted_budget_gib(), abs=0.005)
    assert "fitted" in capacity.inputs()["budget_source"]


def test_roles(rows):
    roles = {key: scenario.role for key, scenario in rows.items()}
    assert roles["kimi-k2.6", "INT4", "BF16"] == "fitted"
    for layout in ("FP8, token scale (nano)", "FP8, tile scale (FlashMLA)"):
        assert roles["kimi-k2.6", "INT4", layout] == roles["glm-5.2", "INT4", layout] == "unpublished"
    assert roles["glm-5.2", "FP8", "BF16"] == roles["glm-5.2", "FP8", "FP8, tensor scale"] == "unpublished"
    assert sum(role == "compared" for role in roles.values()) == 3


def test_each_checkpoint_has_bf16_and_every_fp8_layout(rows):
    """BF16 and the three FP8 page layouts beside every checkpoint (GLM-5.2 also with the published cache), each
    row marked with its layout."""
    caches = {}
    for (model, weights, _), scenario in rows.items():
        caches.setdefault((model, weights), []).append((scenario.kv_dtype, scenario.kv_layout))
    nano_caches = [("bf16", None), ("fp8", "tensor"), ("fp8", "token"), ("fp8", "tile")]
    assert caches == {("kimi-k2.6", "INT4"): nano_caches, ("glm-5.2", "INT4"): [("fp8", "tensor"), *nano_caches],
                      ("glm-5.2", "FP8"): [("fp8", "tensor"), *nano_caches]}


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
    # the tile layout (FlashMLA's): the 512-value latent in FP8 with 4 fp32 scales (one per 128), the rope key in BF16
    assert rows["kimi-k2.6", "INT4", "FP8, tile scale (FlashMLA)"].kv_bytes_per_token == 61 * (512 + 16 + 128) == 40_016
    # GLM-5.2 as nano caches it: 78 layers, the indexer key on its 21 full layers (its FP8 key keeps its scale)
    assert rows["glm-5.2", "INT4", "BF16"].kv_bytes_per_token == 78 * 1152 + 21 * 256 == 95_232
    assert rows["glm-5.2", "INT4", "FP8, tensor scale"].kv_bytes_per_token == 78 * 576 + 21 * 132 == 47_700
    assert rows["glm-5.2", "FP8", "FP8, tile scale (FlashMLA)"].kv_bytes_per_token == 78 * 656 + 21 * 132 == 53_940


@pytest.mark.parametrize("layout,bytes_per_layer", [("BF16", 1152), ("FP8, tensor scale", 576),
                                                    ("FP8, token scale (nano)", 580),
                                                    ("FP8, tile scale (FlashMLA)", 656)])
def test_kimi_tokens_scale_from_the_fitted_686k(rows, layout, bytes_per_layer):
    """The pool the fit leaves beside Kimi's weights holds 686k BF16 tokens of 1,152 B per layer; any other layout
    holds 686k × 1,152 / its bytes per layer (the tile layout's 1.20M, FlashMLA's)."""
    assert rows["kimi-k2.6", "INT4", layout].tokens == pytest.approx(686_000 * 1152 / bytes_per_layer, rel=1e-4)


def test_glm_tokens_scale_from_the_published_figures(rows):
    """GLM-5.2's rows in nano's cache against the published ones: the same pool, so the published tokens × the
    published bytes per token (79 × 708) / the row's bytes (the published figures are within 0.3% of the fit)."""
    for weights, published in (("INT4", 1_180_000), ("FP8", 500_000)):
        for layout, nbytes in (("BF16", 95_232), ("FP8, tensor scale", 47_700), ("FP8, token scale (nano)", 48_012),
                               ("FP8, tile scale (FlashMLA)", 53_940)):
            assert rows["glm-5.2", weights, layout].tokens == pytest.approx(published * 79 * 708 / nbytes, rel=0.005)


def test_fp8_over_bf16_token_ratio():
    ratios = capacity.fp8_token_ratios(capacity.scenarios())
    assert ratios["tensor"] == pytest.approx(1152 / 576, abs=1e-4)          # B per token per layer
    assert ratios["token"] == pytest.approx(1152 / 580, abs=1e-4)           # + nano's fp32 scale per token
    assert ratios["tile"] == pytest.approx(1152 / (512 + 16 + 128), abs=1e-4)


def test_checkpoint_sizes_match_the_published_ones(rows):
    for scenario in rows.values():
        checkpoint = scenario.checkpoint
        assert checkpoint.nbytes / capacity.GIB == pytest.approx(checkpoint.published_gib, rel=0.01)


def test_the_printed_facts_come_from_the_configs():
    assert capacity.layout_facts() == {"kimi_values_per_token_layer": 512 + 64, "fp8_scale_bytes": 4,
                                       "fp8_tile_bytes": {"latent": 512, "scales": 4 * 4, "rope": 2 * 64},
                                       "glm_indexer_layers": 21, "glm_mtp_layers": 1}


def test_the_table_and_json_name_each_rows_layout():
    result = nano("models", "--capacity")
    assert result.exit_code == 0, result.output
    tile = next(line for line in result.stdout.splitlines() if line.startswith(" kimi-k2.6") and "tile" in line)
    assert tile.split("(FlashMLA)")[1].split() == ["40,016", "1.20M"]      # 686k × 1152 / 656; nothing published
    text = " ".join(result.stdout.split())
    assert "1.756× with FlashMLA's scale per 128 latent values and a BF16 rope key (512 + 16 + 128 B)" in text
    data = json.loads(nano("models", "--capacity", "--json").stdout)
    marks = {(row["model"], row["weights"], row["label"]): (row["kv_dtype"], row["kv_layout"], row["role"])
             for row in data["scenarios"]}
    assert marks["kimi-k2.6", "INT4", "BF16"] == ("bf16", None, "fitted")
    assert marks["kimi-k2.6", "INT4", "FP8, tensor scale"] == ("fp8", "tensor", "compared")
    assert marks["glm-5.2", "INT4", "FP8 + indexer, 79 layers"] == ("fp8", "tensor", "compared")
    assert marks["glm-5.2", "FP8", "FP8, tile scale (FlashMLA)"] == ("fp8", "tile", "unpublished")
    assert data["fp8_over_bf16_tokens"] == pytest.approx({"tensor": 2.0, "token": 1152 / 580, "tile": 1152 / 656},
                                                         abs=1e-4)


# ---- the per-GPU plan under nano's tensor / expert parallelism (`nano models --capacity --tp N`) -------------------
# Which part a parameter of nano's model belongs to, by its name (the first match wins): an independent reading of
# the model nano builds, against capacity.parts' arithmetic from the config.
PART_OF_NAME = [
    (r"\.indexer\.", "DSA indexer"),
    (r"\.(q_b_proj|kv_b_proj|o_proj)\.", "attention q_b_proj, kv_b_proj, o_proj"),
    (r"\.(q_a_proj|kv_a_proj_with_mqa)\.", "attention q_a_proj, kv_a_proj_with_mqa"),
    (r"(layernorm\.|^model\.norm\.)", "layernorms"),
    (r"\.mlp\.gate\.", "router (mlp.gate)"),
    (r"\.mlp\.experts\.", "routed experts"),
    (r"\.mlp\.shared_experts\.", "shared experts"),
    (r"\.mlp\.(gate|up|down)_proj\.", "dense MLPs"),
    (r"^(model\.embed_tokens|lm_head)\.", "embed_tokens, lm_head"),
]
MTP_EXTRAS = "MTP eh_proj and norms"   # not in nano's model (nano skips MTP): counted by capacity.parameters alone


def counts_by_part(model: torch.nn.Module, layer_copies: list[int]) -> dict[str, int]:
    """Parameters by part; those of model.layers.i count layer_copies[i] times."""
    counts: dict[str, int] = {}
    for name, param in model.named_parameters():
        part = next(part for pattern, part in PART_OF_NAME if re.search(pattern, name))
        layer = re.match(r"model\.layers\.(\d+)\.", name)
        counts[part] = counts.get(part, 0) + param.numel() * (layer_copies[int(layer.group(1))] if layer else 1)
    return counts


@pytest.fixture(scope="module")
def meta_counts() -> dict[str, dict[str, dict[str, int]]]:
    """Per real config: nano's own Transformer (MTP layers appended as capacity counts them) built on the meta device,
    its parameters by part, whole and after nano/parallel.py's `shard` keeps rank 0 of 8.

    A decoder layer's parameters depend on its kind alone (its MLP type and indexer type: nano/model.py's
    DecoderLayer), so the model is built with one layer of each kind, in the order the kinds first appear, and each
    layer's parameters count as many times as the config has layers of its kind (the whole models, 61 and 79 layers
    of 384 and 256 experts, took 35 s to build on the meta device)."""
    from nano.model import Transformer
    from nano.parallel import shard

    result = {}
    for name in capacity.TP_MODELS:
        cfg = capacity.with_mtp(ModelConfig.from_hf(PRESETS[name].config), capacity.MTP_LAYERS[name])
        layers = list(zip(cfg.mlp_layer_types, cfg.indexer_types or [None] * cfg.num_hidden_layers))
        kinds = list(dict.fromkeys(layers))
        one_of_each = dataclasses.replace(
            cfg, num_hidden_layers=len(kinds), mlp_layer_types=[mlp for mlp, _ in kinds],
            indexer_types=None if cfg.indexer_types is None else [indexer for _, indexer in kinds])
        copies = [layers.count(kind) for kind in kinds]
        model = Transformer(one_of_each, dtype=torch.bfloat16, materialize=False)
        whole = counts_by_part(model, copies)
        shard(model, SimpleNamespace(rank=0, world=8, step=None, control=None, device=torch.device("cpu")))
        result[name] = {"whole": whole, "rank0_of_8": counts_by_part(model, copies)}
    return result


def plan_parts(name: str) -> list[capacity.Part]:
    return capacity.parts(ModelConfig.from_hf(PRESETS[name].config), capacity.MTP_LAYERS[name])


@pytest.mark.parametrize("name", capacity.TP_MODELS)
def test_the_parts_are_nanos_model_whole_and_as_shard_cuts_it(meta_counts, name):
    """capacity.parts, from the config's dimensions, against the parameter shapes of nano's model on the meta device:
    each part's count whole, and on rank 0 of 8 after nano/parallel.py's shard (heads, experts, rows, vocabulary
    split; the replicated parts whole)."""
    parts = {part.name: part for part in plan_parts(name) if part.name != MTP_EXTRAS}
    expected_whole = {n: p.params for n, p in parts.items() if p.params}
    expected_rank0 = {n: p.rank_params(8, 0) for n, p in parts.items() if p.params}
    assert meta_counts[name]["whole"] == expected_whole
    assert meta_counts[name]["rank0_of_8"] == expected_rank0
    total = sum(meta_counts[name]["whole"].values()) + sum(p.params for p in plan_parts(name) if p.name == MTP_EXTRAS)
    assert total == capacity.parameters(ModelConfig.from_hf(PRESETS[name].config), capacity.MTP_LAYERS[name])[0]


@pytest.mark.parametrize("tp", [2, 8, 64])
def test_the_ranks_hold_the_whole_model_plus_the_replicated_parts_once_more_each(meta_counts, tp):
    """Σ over ranks of a rank's bytes = the single-device checkpoint + (N-1) × the replicated bytes, with the
    right-hand side computed another way: the checkpoint by capacity.weight_bytes (from ModelConfig.num_parameters),
    the replicated bytes from the replicated modules' parameters in nano's meta-device model."""
    replicated_names = {"attention q_a_proj, kv_a_proj_with_mqa", "layernorms", "DSA indexer", "router (mlp.gate)"}
    for plan in capacity.tp_plans(tp):
        cfg, mtp = ModelConfig.from_hf(PRESETS[plan.model].config), capacity.MTP_LAYERS[plan.model]
        mtp_extras = mtp * (2 * cfg.hidden_size ** 2 + 3 * cfg.hidden_size)
        replicated_params = sum(n for part, n in meta_counts[plan.model]["whole"].items() if part in replicated_names)
        replicated = capacity.format_bytes_of({"other": replicated_params + mtp_extras}, plan.weights)
        single = capacity.weight_bytes(cfg, plan.weights, mtp)
        over_ranks = sum(plan.rank_bytes(rank) for rank in range(tp))
        assert abs(over_ranks - (single + (tp - 1) * replicated)) < 1, (plan.model, plan.weights)
        assert plan.replicated_bytes == replicated


def test_tp1_is_the_single_device_plan():
    """--tp 1: each checkpoint whole on one GPU, its bytes those of the single-device sizing (nano models and the
    --capacity checkpoints), the KV bytes per token nano's, and the --capacity plan's budget; at TP=8 the even split
    of the whole is the --capacity plan's weights per GPU."""
    existing = {(c.model, c.weights): c for c in dict.fromkeys(s.checkpoint for s in capacity.scenarios())}
    nano_layout = {s.checkpoint.model: s.kv_bytes_per_token for s in capacity.scenarios() if s.kv_layout == "token"}
    for plan, plan8 in zip(capacity.tp_plans(1), capacity.tp_plans(8)):
        cfg = ModelConfig.from_hf(PRESETS[plan.model].config)
        single = capacity.weight_bytes(cfg, plan.weights, capacity.MTP_LAYERS[plan.model])
        assert plan.weights_per_gpu_bytes - single in (0, 1)               # exact bytes, rounded up
        assert plan.kv_pool_bytes == int(capacity.BUDGET_GIB * capacity.GIB) - plan.weights_per_gpu_bytes
        assert not plan.fits and plan.tokens_per_gpu("bf16") == 0          # no checkpoint fits one H200's budget
        assert plan.kv_bytes_per_token == plan8.kv_bytes_per_token == {"bf16": cfg.kv_bytes_per_token("bf16"),
                                                                        "fp8": cfg.kv_bytes_per_token("fp8")}
        assert plan.kv_bytes_per_token["fp8"] == nano_layout[plan.model]
        if (plan.model, plan.weights) in existing:
            checkpoint = existing[plan.model, plan.weights]
            assert plan.weights_per_gpu_bytes - checkpoint.nbytes in (0, 1)
            assert plan8.as_dict()["even_split_gib_per_gpu"] == checkpoint.as_dict()["weights_per_gpu_gib"]


def test_the_tp8_plan():
    """The figures `nano models --capacity --tp 8` prints, by construction: 48 / 32 experts per GPU, the replicated
    parts on top of an eighth of the rest, every rank caching the whole latent."""
    plans = {(p.model, p.weights): p for p in capacity.tp_plans(8)}
    models = {m["model"]: m for m in capacity.tp_models(list(plans.values()))}
    assert (models["kimi-k2.6"]["experts_per_gpu"], models["glm-5.2"]["experts_per_gpu"]) == (384 // 8, 256 // 8)
    kimi = plans["kimi-k2.6", "INT4"]
    split = kimi.total_bytes - kimi.replicated_bytes
    assert kimi.weights_per_gpu_bytes == pytest.approx(float(kimi.replicated_bytes + split / 8), abs=1)
    # the replicated ~2 GiB per GPU cost Kimi's fitted 686k BF16 tokens about 27k
    even = capacity.published_even_split()
    assert even["even_split_gib_per_gpu"] == pytest.approx(69.17, abs=0.01)
    assert kimi.tokens_per_gpu("bf16") == even["tokens_per_gpu"] == pytest.approx(659_000, rel=0.001)
    assert kimi.tokens_per_gpu("bf16") < 686_000
    assert not plans["kimi-k2.6", "BF16"].fits and not plans["kimi-k2.6", "FP8"].fits
    assert plans["glm-5.2", "INT4"].tokens_per_gpu("fp8") == pytest.approx(1_316_000, rel=0.001)
    assert plans["glm-5.2", "FP8"].tokens_per_gpu("fp8") == pytest.approx(554_000, rel=0.001)


def test_tp_output_and_json():
    result = nano("models", "--capacity", "--tp", "8")
    assert result.exit_code == 0, result.output
    for text in ("TP=8", "kimi-k2.6 48, glm-5.2 32 per GPU", "does not fit",
                 "Per node", "DP attention", "tokens/GPU BF16 KV"):
        assert text in result.stdout
    data = json.loads(nano("models", "--capacity", "--tp", "8", "--json").stdout)
    assert set(data) == {"inputs", "models", "published_even_split", "per_node"}
    assert data["inputs"]["tensor_parallel"] == 8 and "fitted" in data["inputs"]["budget_source"]
    assert set(data["inputs"]["sources"]) >= {"params", "bytes", "kv_bytes_per_token", "tokens", "budget_gib"}
    kimi = data["models"][0]
    assert set(kimi) == {"model", "tp", "attention_heads", "heads_per_gpu", "routed_experts", "experts_per_gpu",
                         "mtp_layers", "parts", "params", "params_per_gpu", "kv_bytes_per_token_per_gpu",
                         "kv_replicated", "weights"}
    assert [row["weights"] for row in kimi["weights"]] == ["BF16", "FP8", "INT4"]
    assert set(kimi["weights"][0]) == {"model", "weights", "tp", "bytes", "replicated_bytes", "split_bytes",
                                       "bytes_per_gpu", "gib", "replicated_gib", "split_gib_per_gpu", "gib_per_gpu",
                                       "even_split_gib_per_gpu", "kv_pool_gib", "fits", "tokens_per_gpu",
                                       "tokens_per_node"}
    int4 = kimi["weights"][2]
    assert int4["tokens_per_node"] == int4["tokens_per_gpu"]     # the latent is replicated: a node holds one GPU's
    assert set(kimi["parts"][0]) == {"name", "split", "params", "params_per_gpu"}


@pytest.mark.parametrize("args,fragment", [
    (["--capacity", "--tp", "3"], "--tp 3 must divide the attention heads"),
    (["--capacity", "--tp", "128"], "--tp 128 must divide the attention heads"),
    (["--capacity", "--tp", "0"], "--tp"),
    (["--tp", "8"], "--tp does nothing without --capacity"),
])
def test_a_bad_tp_is_one_error_line(args, fragment):
    assert_user_error(nano("models", *args), fragment, exit_code=2)
