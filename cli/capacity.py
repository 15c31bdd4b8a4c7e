"""How many tokens of context fit on one 8×H200 node: the published capacity claims, recomputed from the configs.

One set of assumptions reconciles the published numbers (Kimi K2.6: ~686k tokens with a BF16 cache, ~1.37M in
FP8; GLM-5.2 with INT4 experts: ~1.18M):

  * 8 H200s of 143,771 MiB (140.4 GiB) each; checkpoint sizes in GiB;
  * tensor parallelism over the 8 GPUs. MLA caches one latent per token, shared by every head — a single
    "KV head" that cannot be split — so every GPU holds the whole cache of every token: the per-GPU pool is
    the node's context capacity;
  * the weights split evenly over the 8 GPUs;
  * the weights and the KV pool share a budget of 114.07 GiB per GPU (81% of its memory); the rest goes to
    activations, CUDA graphs and communication buffers.

Then tokens = (budget - checkpoint / 8) / KV bytes per token. Checkpoint sizes come from the parameter counts
of the real configs (`nano.presets`), KV bytes from `ModelConfig.kv_bytes_per_token`. Each checkpoint is set
beside a BF16 cache and each FP8 page layout (nano/kv.py): "tensor" is the published arithmetic (1 byte a value,
as SGLang and vLLM store it), "token" nano's default (+ a scale per token), "tile" FlashMLA's (a scale per 128
latent values, the rope key in BF16); only the published caches have a figure to compare with.

The budget is FITTED, not derived: no spec gives it. It is solved from one published figure, Kimi K2.6's 686k
BF16 tokens (69.2 GiB of weights per GPU + 686,000 × 70,272 B = 114.07 GiB). The other published figures are then
compared with what that budget predicts; they agree within 1%, but the assumptions above were chosen so that
they would. So this module reproduces the claims as a consistent fit, not as an independent derivation.

`tp_plans(N)` (`nano models --capacity --tp N`) is the per-GPU plan under nano's own tensor / expert parallelism:
each part of the model split or replicated as nano/parallel.py does (`parts`), the bytes a GPU holds in each weight
format, and the tokens the same budget leaves room for. Unlike the fit above it keeps the replicated parts whole on
every GPU, so Kimi K2.6's INT4 weights take 71.0 GiB per GPU rather than 553.4 / 8 = 69.2.
"""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from fractions import Fraction
from typing import Any, Literal

from nano.config import ModelConfig
from nano.presets import PRESETS

from .console import UsageError

GIB = 2**30
GPU_MEMORY_MIB = 143_771           # one H200, as nvidia-smi reports it
GPUS = 8                           # tensor-parallel degree = GPUs in the node
BUDGET_GIB = 114.07                # weights + KV pool per GPU: FITTED to FITTED_TO (see the docstring)
INT4_BYTES_PER_PARAM = 0.5 + 2 / 32   # 4-bit values + one bf16 scale per group of 32 (compressed-tensors g32)
FP8_BLOCK = 128 * 128              # FP8 checkpoints: one fp32 scale per 128×128 block

Weights = Literal["INT4", "FP8"]
# the FP8 page layouts (nano/kv.py) as the table names them: whose cache each is. "tensor" is the published
# arithmetic (1 byte a value, one scale per layer: SGLang's and vLLM's FP8 MLA cache)
FP8_LAYOUTS = {"tensor": "FP8, tensor scale", "token": "FP8, token scale (nano)", "tile": "FP8, tile scale (FlashMLA)"}
PUBLISHED_LAYOUT = "tensor"

# the published figure BUDGET_GIB is solved from: (model, weights, KV dtype, tokens)
FITTED_TO = ("kimi-k2.6", "INT4", "bf16", 686_000)
BUDGET_SOURCE = ("fitted: solved from Kimi K2.6's published 686k BF16 tokens (weights per GPU + 686,000 × KV "
                 "bytes per token); the other published figures are compared with it, so this is a fit, not an "
                 "independent derivation")

# GLM-5.x ships one multi-token-prediction layer (model.layers.78) that serving engines load for speculative
# decoding; nano skips it. The presets hold only what nano reads, so the count is stated here.
MTP_LAYERS = {"kimi-k2.6": 0, "glm-5.2": 1}


@dataclass(frozen=True)
class Checkpoint:
    """A released (or recipe) checkpoint: its size, its share of each GPU, and the KV pool left beside it."""
    model: str
    weights: Weights
    params: int
    nbytes: int
    published_gib: float          # the size the published arithmetic used

    @property
    def weights_per_gpu_bytes(self) -> int:
        return self.nbytes // GPUS

    @property
    def kv_pool_bytes(self) -> int:
        return int(BUDGET_GIB * GIB) - self.weights_per_gpu_bytes

    def as_dict(self) -> dict[str, Any]:
        return {"model": self.model, "weights": self.weights, "params": self.params,
                "gib": round(self.nbytes / GIB, 2), "published_gib": self.published_gib,
                "weights_per_gpu_gib": round(self.weights_per_gpu_bytes / GIB, 2),
                "kv_pool_gib": round(self.kv_pool_bytes / GIB, 2)}


@dataclass(frozen=True)
class Scenario:
    """One row of the reconciliation: a checkpoint, a KV cache (dtype, FP8 layout) and the tokens that fit."""
    checkpoint: Checkpoint
    kv_dtype: Literal["bf16", "fp8"]
    kv_layout: str | None         # FP8: the page layout (FP8_LAYOUTS); BF16: None
    kv_bytes_per_token: int
    published_tokens: int | None  # None: nothing published for this cache
    label: str                    # how the table names the cache

    @property
    def tokens(self) -> int:
        return self.checkpoint.kv_pool_bytes // self.kv_bytes_per_token

    @property
    def role(self) -> str:
        """"fitted": the row BUDGET_GIB is solved from (it matches by construction); "compared": a published
        figure set beside what the fitted budget predicts; "unpublished": what the fitted budget predicts for a
        cache with no published figure (nano's layouts, FlashMLA's)."""
        if self.published_tokens is None:
            return "unpublished"
        key = (self.checkpoint.model, self.checkpoint.weights, self.kv_dtype, self.published_tokens)
        return "fitted" if key == FITTED_TO else "compared"

    def as_dict(self) -> dict[str, Any]:
        return {"model": self.checkpoint.model, "weights": self.checkpoint.weights, "kv_dtype": self.kv_dtype,
                "kv_layout": self.kv_layout, "label": self.label, "kv_bytes_per_token": self.kv_bytes_per_token,
                "tokens": self.tokens, "published_tokens": self.published_tokens, "role": self.role}


def with_mtp(cfg: ModelConfig, mtp_layers: int) -> ModelConfig:
    """The config with its MTP layers appended as ordinary MoE layers (indexer included, for GLM-5)."""
    if not mtp_layers:
        return cfg
    return dataclasses.replace(
        cfg, num_hidden_layers=cfg.num_hidden_layers + mtp_layers,
        mlp_layer_types=cfg.mlp_layer_types + ["sparse"] * mtp_layers,
        indexer_types=None if cfg.indexer_types is None else cfg.indexer_types + ["full"] * mtp_layers)


def parameters(cfg: ModelConfig, mtp_layers: int) -> tuple[int, int, int]:
    """(all parameters, routed-expert parameters, embedding + lm_head parameters), MTP layers included.
    An MTP layer is a decoder layer plus eh_proj [h, 2h] and three norms."""
    full = with_mtp(cfg, mtp_layers)
    h = cfg.hidden_size
    total = full.num_parameters() + mtp_layers * (2 * h * h + 3 * h)
    routed = full.mlp_layer_types.count("sparse") * cfg.n_routed_experts * 3 * h * cfg.moe_intermediate_size
    return total, routed, 2 * cfg.vocab_size * h


def checkpoint(name: str, weights: Weights, published_gib: float) -> Checkpoint:
    """Size a checkpoint from the preset's config.

    INT4 experts (Kimi's release, and the same recipe for GLM): routed experts at 4 bits + a bf16 scale per 32,
    everything else BF16. FP8 (GLM's release): 1 byte per weight + an fp32 scale per 128×128 block, with
    BF16 embeddings and lm_head (norms and router stay BF16 too; they are too small to show)."""
    cfg = ModelConfig.from_hf(PRESETS[name].config)
    total = parameters(cfg, MTP_LAYERS[name])[0]
    return Checkpoint(name, weights, total, weight_bytes(cfg, weights, MTP_LAYERS[name]), published_gib)


def weight_bytes(cfg: ModelConfig, weights: str, mtp_layers: int = 0) -> int:
    """Bytes of the model's weights stored as "BF16", "FP8" (128×128 blocks, BF16 embeddings), "INT4" (routed
    experts only, the rest BF16) or "FP8+INT4" (the phase policy in one process: everything FP8 for prefill, plus
    INT4 routed experts for decode, both resident; in the split each worker holds only its own)."""
    total, routed, embeddings = parameters(cfg, mtp_layers)
    if weights == "FP8+INT4":
        return weight_bytes(cfg, "FP8", mtp_layers) + round(routed * INT4_BYTES_PER_PARAM)
    if weights == "INT4":
        return round(routed * INT4_BYTES_PER_PARAM) + 2 * (total - routed)
    if weights == "FP8":
        fp8 = total - embeddings
        return fp8 + 4 * fp8 // FP8_BLOCK + 2 * embeddings
    return 2 * total


def published_glm_kv_bytes(cfg: ModelConfig, mtp_layers: int) -> int:
    """The published GLM-5 layout: an FP8 latent plus an FP8 indexer key (128 B + fp32 scale) on every layer,
    MTP included, as engines that allocate the indexer cache per layer do: 79 × (576 + 132) = 55,932 B."""
    full = with_mtp(cfg, mtp_layers)
    every_layer = dataclasses.replace(full, indexer_types=["full"] * full.num_hidden_layers)
    return every_layer.kv_bytes_per_token("fp8", "tensor")


def config_scenarios(check: Checkpoint, cfg: ModelConfig, published: dict[str, int]) -> list[Scenario]:
    """A checkpoint beside nano's cache of its config (its own layers and indexer layers), in BF16 and each FP8
    layout; `published` holds the published tokens by layout ("bf16" for BF16) where there is a figure."""
    rows = [Scenario(check, "bf16", None, cfg.kv_bytes_per_token("bf16"), published.get("bf16"), "BF16")]
    return rows + [Scenario(check, "fp8", layout, cfg.kv_bytes_per_token("fp8", layout), published.get(layout),
                            label) for layout, label in FP8_LAYOUTS.items()]


def scenarios() -> list[Scenario]:
    """Per checkpoint: the published cache where it differs from nano's (GLM-5.2: an indexer key on every layer,
    MTP included), then BF16 and each FP8 layout of the config's own cache."""
    kimi_cfg = ModelConfig.from_hf(PRESETS["kimi-k2.6"].config)
    glm_cfg = ModelConfig.from_hf(PRESETS["glm-5.2"].config)
    kimi = checkpoint("kimi-k2.6", "INT4", published_gib=553)
    glm_int4 = checkpoint("glm-5.2", "INT4", published_gib=421)
    glm_fp8 = checkpoint("glm-5.2", "FP8", published_gib=705)
    glm_published = published_glm_kv_bytes(glm_cfg, MTP_LAYERS["glm-5.2"])
    with_indexer = f"FP8 + indexer, {glm_cfg.num_hidden_layers + MTP_LAYERS['glm-5.2']} layers"
    rows = config_scenarios(kimi, kimi_cfg, {"bf16": 686_000, PUBLISHED_LAYOUT: 1_372_000})
    for check, published in ((glm_int4, 1_180_000), (glm_fp8, 500_000)):
        rows += [Scenario(check, "fp8", PUBLISHED_LAYOUT, glm_published, published, with_indexer),
                 *config_scenarios(check, glm_cfg, {})]
    return rows


def fp8_token_ratios(scenarios: list[Scenario]) -> dict[str, float]:
    """Kimi's FP8 tokens over its BF16 tokens, by layout: 1152 / 576 = 2 (tensor), 1152 / 580 = 1.986 (token),
    1152 / 656 = 1.756 (tile)."""
    kimi = {s.kv_layout: s.tokens for s in scenarios if s.checkpoint.model == "kimi-k2.6"}
    return {layout: kimi[layout] / kimi[None] for layout in FP8_LAYOUTS}


def fitted_budget_gib() -> float:
    """The budget that makes FITTED_TO come out exactly: its checkpoint's share of a GPU + its tokens' KV bytes.
    BUDGET_GIB is this number rounded; a test keeps them in step when a preset changes."""
    scenario = next(s for s in scenarios() if (s.checkpoint.model, s.checkpoint.weights, s.kv_dtype,
                                               s.published_tokens) == FITTED_TO)
    return (scenario.checkpoint.weights_per_gpu_bytes + FITTED_TO[-1] * scenario.kv_bytes_per_token) / GIB


def layout_facts() -> dict[str, Any]:
    """The numbers the printed notes quote, read from the configs: Kimi's latent + rope values per token per
    layer, the bytes of nano's FP8 token scale beside them, and the tile layout's parts (FP8 latent, its scales,
    BF16 rope key); GLM-5.2's indexer layers and MTP layers."""
    kimi = ModelConfig.from_hf(PRESETS["kimi-k2.6"].config)
    glm = ModelConfig.from_hf(PRESETS["glm-5.2"].config)
    per_layer = {layout: kimi.kv_bytes_per_token("fp8", layout) // kimi.num_hidden_layers for layout in FP8_LAYOUTS}
    latent, rope = kimi.kv_lora_rank, 2 * kimi.qk_rope_head_dim
    return {"kimi_values_per_token_layer": kimi.kv_values_per_token_layer,
            "fp8_scale_bytes": per_layer["token"] - per_layer["tensor"],
            "fp8_tile_bytes": {"latent": latent, "scales": per_layer["tile"] - latent - rope, "rope": rope},
            "glm_indexer_layers": len(glm.indexer_layers), "glm_mtp_layers": MTP_LAYERS["glm-5.2"]}


def inputs() -> dict[str, Any]:
    gpu_gib = GPU_MEMORY_MIB / 1024
    return {"gpus": GPUS, "gpu": "H200", "gpu_memory_mib": GPU_MEMORY_MIB, "gpu_memory_gib": round(gpu_gib, 2),
            "tensor_parallel": GPUS, "budget_gib": BUDGET_GIB, "budget_fraction": round(BUDGET_GIB / gpu_gib, 4),
            "budget_source": BUDGET_SOURCE}


# ---- the per-GPU plan under nano's tensor / expert parallelism (`nano models --capacity --tp N`) -------------------
#
# How nano/parallel.py splits a model over N ranks (its `shard`): attention by heads (q_b_proj and kv_b_proj keep
# their heads' rows, o_proj the matching input columns); routed experts divided among ranks, whole experts;
# shared experts and dense MLPs by intermediate rows (gate/up rows, down columns); embed_tokens and lm_head by
# vocabulary. Replicated on every rank: q_a_proj, kv_a_proj_with_mqa, the layernorms, the router and the DSA indexer.
# The latent cache is replicated too: every rank computes and caches the whole 576-value latent (and GLM-5's indexer
# keys) of every token, so a rank's KV bytes per token are one device's.

TP_DEFAULT = 8
TP_MODELS = ("kimi-k2.6", "glm-5.2")
TP_FORMATS = ("BF16", "FP8", "INT4")
REPLICATED = "replicated"


def gib(nbytes: int | Fraction) -> float:
    return round(float(nbytes) / GIB, 2)


def rank_span(total: int, world: int, rank: int) -> tuple[int, int]:
    """This rank's contiguous share [start, stop) of `total` items, the first `total % world` ranks one longer:
    the rule nano/parallel.py splits heads, experts, rows and the vocabulary with."""
    base, extra = divmod(total, world)
    start = rank * base + min(rank, extra)
    return start, start + base + (rank < extra)


@dataclass(frozen=True)
class Part:
    """A group of parameters and how the ranks hold it: `units` things (heads, experts, intermediate rows, vocabulary
    rows) of `unit_params` parameters each, over all layers, divided among ranks; or, split "replicated", the
    whole group on every rank (units = 1)."""
    name: str
    split: str              # "heads" | "experts" | "rows" | "vocabulary" | REPLICATED
    units: int
    unit_params: int
    kind: str               # how a weight format stores it: "routed" (INT4 experts), "embedding" (BF16 in FP8), "other"

    @property
    def params(self) -> int:
        return self.units * self.unit_params

    @property
    def replicated(self) -> bool:
        return self.split == REPLICATED

    def rank_params(self, world: int, rank: int) -> int:
        if self.replicated:
            return self.params
        start, stop = rank_span(self.units, world, rank)
        return (stop - start) * self.unit_params


def parts(cfg: ModelConfig, mtp_layers: int) -> list[Part]:
    """Every parameter of the model (MTP layers as `parameters` counts them) in the groups the ranks split alike, by
    construction from the config's dimensions. Their sum is `parameters(cfg, mtp_layers)[0]`."""
    full, h, heads = with_mtp(cfg, mtp_layers), cfg.hidden_size, cfg.num_attention_heads
    layers = full.num_hidden_layers
    sparse, dense = full.mlp_layer_types.count("sparse"), full.mlp_layer_types.count("dense")
    q_lora = cfg.q_lora_rank or 0
    per_head = (q_lora if q_lora else h) * cfg.qk_head_dim \
        + cfg.kv_lora_rank * (cfg.qk_nope_head_dim + cfg.v_head_dim) + cfg.v_head_dim * h
    indexer = (q_lora * cfg.index_n_heads * cfg.index_head_dim + h * cfg.index_head_dim + 2 * cfg.index_head_dim
               + h * cfg.index_n_heads) if cfg.has_indexer else 0
    vocab_rows = 1 if cfg.tie_word_embeddings else 2
    return [
        Part("attention q_b_proj, kv_b_proj, o_proj", "heads", heads, layers * per_head, "other"),
        Part("attention q_a_proj, kv_a_proj_with_mqa", REPLICATED, 1,
             layers * (h * q_lora + h * cfg.kv_values_per_token_layer), "other"),
        Part("layernorms", REPLICATED, 1, layers * (q_lora + cfg.kv_lora_rank + 2 * h) + h, "other"),
        Part("DSA indexer", REPLICATED, 1, len(full.indexer_layers) * indexer, "other"),
        Part("router (mlp.gate)", REPLICATED, 1, sparse * cfg.n_routed_experts * (h + 1), "other"),
        Part("routed experts", "experts", cfg.n_routed_experts, sparse * 3 * h * cfg.moe_intermediate_size, "routed"),
        Part("shared experts", "rows", cfg.n_shared_experts * cfg.moe_intermediate_size, sparse * 3 * h, "other"),
        Part("dense MLPs", "rows", cfg.intermediate_size, dense * 3 * h, "other"),
        Part("embed_tokens, lm_head", "vocabulary", cfg.vocab_size, vocab_rows * h, "embedding"),
        Part("MTP eh_proj and norms", REPLICATED, 1, mtp_layers * (2 * h * h + 3 * h), "other"),
    ]


def format_bytes_of(params: dict[str, int], weights: str) -> Fraction:
    """Bytes of parameters by kind in a weight format, as `weight_bytes` sizes a checkpoint, but exact (a Fraction:
    the FP8 block scales and the INT4 group scales are a fixed share of each weight), so that the bytes of the parts
    add up to the bytes of the whole. BF16: 2 B. INT4: routed experts 4 bits + a bf16 scale per 32, the rest BF16.
    FP8: 1 B + an fp32 scale per 128×128 block, embed_tokens and lm_head BF16."""
    routed, embedding, other = params.get("routed", 0), params.get("embedding", 0), params.get("other", 0)
    if weights == "INT4":
        return Fraction(INT4_BYTES_PER_PARAM) * routed + 2 * (embedding + other)
    if weights == "FP8":
        return (1 + Fraction(4, FP8_BLOCK)) * (routed + other) + 2 * embedding
    if weights == "BF16":
        return Fraction(2 * (routed + embedding + other))
    raise ValueError(f"unknown weight format {weights!r}")


def _by_kind(counts: list[tuple[Part, int]]) -> dict[str, int]:
    kinds: dict[str, int] = {}
    for part, count in counts:
        kinds[part.kind] = kinds.get(part.kind, 0) + count
    return kinds


@dataclass(frozen=True)
class RankPlan:
    """One model in one weight format on `world` ranks: the bytes each rank holds, the KV pool the budget leaves
    beside them and the tokens it fits. Every rank caches the whole latent, so the ranks together hold as many
    tokens as one."""
    model: str
    weights: str
    world: int
    parts: tuple[Part, ...]
    kv_bytes_per_token: dict[str, int]      # by KV dtype: "bf16", "fp8" (nano's layout); per rank = one device's

    def rank_bytes(self, rank: int) -> Fraction:
        return format_bytes_of(_by_kind([(p, p.rank_params(self.world, rank)) for p in self.parts]), self.weights)

    @property
    def total_bytes(self) -> Fraction:
        """The single-device figure: every part whole (= weight_bytes, exactly)."""
        return format_bytes_of(_by_kind([(p, p.params) for p in self.parts]), self.weights)

    @property
    def replicated_bytes(self) -> Fraction:
        return format_bytes_of(_by_kind([(p, p.params) for p in self.parts if p.replicated]), self.weights)

    @property
    def weights_per_gpu_bytes(self) -> int:
        """The largest rank's bytes (rank 0: the ranks split alike, the first ones one unit longer when uneven)."""
        return math.ceil(max(self.rank_bytes(rank) for rank in {0, self.world - 1}))

    @property
    def kv_pool_bytes(self) -> int:
        return int(BUDGET_GIB * GIB) - self.weights_per_gpu_bytes

    def tokens_per_gpu(self, kv_dtype: str) -> int:
        return max(self.kv_pool_bytes, 0) // self.kv_bytes_per_token[kv_dtype]

    @property
    def fits(self) -> bool:
        return self.kv_pool_bytes > 0

    def as_dict(self) -> dict[str, Any]:
        tokens = {dtype: self.tokens_per_gpu(dtype) for dtype in self.kv_bytes_per_token}
        split = self.total_bytes - self.replicated_bytes
        return {"model": self.model, "weights": self.weights, "tp": self.world,
                "bytes": round(self.total_bytes), "replicated_bytes": round(self.replicated_bytes),
                "split_bytes": round(split), "bytes_per_gpu": self.weights_per_gpu_bytes,
                "gib": gib(self.total_bytes), "replicated_gib": gib(self.replicated_bytes),
                "split_gib_per_gpu": gib(split / self.world), "gib_per_gpu": gib(self.weights_per_gpu_bytes),
                "even_split_gib_per_gpu": gib(self.total_bytes / self.world),
                "kv_pool_gib": gib(self.kv_pool_bytes), "fits": self.fits,
                "tokens_per_gpu": tokens, "tokens_per_node": dict(tokens)}


def check_tp(tp: int) -> None:
    """--tp N must be >= 1 and divide every planned model's attention heads (nano splits whole heads)."""
    heads = {name: ModelConfig.from_hf(PRESETS[name].config).num_attention_heads for name in TP_MODELS}
    if tp < 1 or any(count % tp for count in heads.values()):
        valid = [n for n in range(1, max(heads.values()) + 1) if all(count % n == 0 for count in heads.values())]
        counts = ", ".join(f"{name} {count}" for name, count in heads.items())
        raise UsageError(f"--tp {tp} must divide the attention heads ({counts}): one of "
                         f"{', '.join(map(str, valid))}")


def tp_plans(tp: int = TP_DEFAULT) -> list[RankPlan]:
    """The per-GPU plan of each real config in each weight format on `tp` ranks."""
    check_tp(tp)
    plans = []
    for name in TP_MODELS:
        cfg = ModelConfig.from_hf(PRESETS[name].config)
        kv = {"bf16": cfg.kv_bytes_per_token("bf16"), "fp8": cfg.kv_bytes_per_token("fp8")}
        model_parts = tuple(parts(cfg, MTP_LAYERS[name]))
        plans += [RankPlan(name, fmt, tp, model_parts, kv) for fmt in TP_FORMATS]
    return plans


def tp_models(plans: list[RankPlan]) -> list[dict[str, Any]]:
    """Per model: how its parts split on the plan's ranks (parameters whole and per GPU), its KV bytes per token per
    GPU, and its plan in each weight format."""
    models: dict[str, dict[str, Any]] = {}
    for plan in plans:
        if plan.model not in models:
            cfg = ModelConfig.from_hf(PRESETS[plan.model].config)
            models[plan.model] = {
                "model": plan.model, "tp": plan.world, "attention_heads": cfg.num_attention_heads,
                "heads_per_gpu": cfg.num_attention_heads // plan.world,
                "routed_experts": cfg.n_routed_experts,
                "experts_per_gpu": rank_span(cfg.n_routed_experts, plan.world, 0)[1],
                "mtp_layers": MTP_LAYERS[plan.model],
                "parts": [{"name": p.name, "split": p.split, "params": p.params,
                           "params_per_gpu": p.rank_params(plan.world, 0)} for p in plan.parts],
                "params": sum(p.params for p in plan.parts),
                "params_per_gpu": sum(p.rank_params(plan.world, 0) for p in plan.parts),
                "kv_bytes_per_token_per_gpu": dict(plan.kv_bytes_per_token), "kv_replicated": True,
                "weights": []}
        models[plan.model]["weights"].append(plan.as_dict())
    return list(models.values())


def published_even_split() -> dict[str, Any]:
    """What keeping the replicated parts whole changes in the fitted row (Kimi K2.6, INT4, BF16 KV, on the node's
    GPUS ranks): the published 686k divides the whole checkpoint by the GPUs; nano's ranks each hold the replicated
    parts whole."""
    model, weights, _, published = FITTED_TO
    plan = next(p for p in tp_plans(GPUS) if (p.model, p.weights) == (model, weights))
    return {"model": model, "weights": weights, "kv_dtype": "bf16", "tp": GPUS, "published_tokens": published,
            "even_split_gib_per_gpu": gib(plan.total_bytes / plan.world),
            "gib_per_gpu": gib(plan.weights_per_gpu_bytes),
            "tokens_per_gpu": plan.tokens_per_gpu("bf16")}


def tp_inputs(tp: int) -> dict[str, Any]:
    return {**inputs(), "tensor_parallel": tp, "gpus": tp,
            "sources": {
                "params": "by construction: the configs' dimensions (nano.presets), split as nano/parallel.py does",
                "bytes": "by construction: params × each format's bytes per parameter (format_bytes_of)",
                "kv_bytes_per_token": "by construction: ModelConfig.kv_bytes_per_token, one device's on every GPU "
                                      "(the latent is replicated)",
                "tokens": "by construction: (budget − bytes per GPU) // KV bytes per token",
                "gpu_memory_mib": "quoted: an H200 as nvidia-smi reports it",
                "published_tokens": "quoted: the published capacity figure",
                "budget_gib": "fitted: see budget_source"}}
