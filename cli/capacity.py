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
of the real configs (`nano.presets`), KV bytes from `ModelConfig.kv_bytes_per_token`.

The budget is FITTED, not derived: no spec gives it. It is solved from one published figure, Kimi K2.6's 686k
BF16 tokens (69.2 GiB of weights per GPU + 686,000 × 70,272 B = 114.07 GiB). The other published figures are then
compared with what that budget predicts; they agree within 1%, but the assumptions above were chosen so that
they would. So this module reproduces the claims as a consistent fit, not as an independent derivation.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Literal

from nano.config import ModelConfig
from nano.presets import PRESETS

GIB = 2**30
GPU_MEMORY_MIB = 143_771           # one H200, as nvidia-smi reports it
GPUS = 8                           # tensor-parallel degree = GPUs in the node
BUDGET_GIB = 114.07                # weights + KV pool per GPU: FITTED to FITTED_TO (see the docstring)
INT4_BYTES_PER_PARAM = 0.5 + 2 / 32   # 4-bit values + one bf16 scale per group of 32 (compressed-tensors g32)
FP8_BLOCK = 128 * 128              # FP8 checkpoints: one fp32 scale per 128×128 block

Weights = Literal["INT4", "FP8"]
BF16 = "BF16"
FP8_PER_TENSOR = "FP8, tensor scale"            # 1 byte per value, one scale for the whole cache
FP8_NANO = "FP8, token scale (nano)"            # + an fp32 scale per token per layer (KVPool's layout)

# the published figure BUDGET_GIB is solved from: (model, weights, KV layout, tokens)
FITTED_TO = ("kimi-k2.6", "INT4", BF16, 686_000)
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
    """One row of the reconciliation: a checkpoint, a KV-cache layout, and the tokens that fit."""
    checkpoint: Checkpoint
    kv_layout: str
    kv_bytes_per_token: int
    published_tokens: int | None  # None: nano's own layout, not part of the published claims

    @property
    def tokens(self) -> int:
        return self.checkpoint.kv_pool_bytes // self.kv_bytes_per_token

    @property
    def role(self) -> str:
        """"fitted": the row BUDGET_GIB is solved from (it matches by construction); "compared": a published
        figure set beside what the fitted budget predicts; "nano": nano's own layout, with nothing published."""
        if self.published_tokens is None:
            return "nano"
        key = (self.checkpoint.model, self.checkpoint.weights, self.kv_layout, self.published_tokens)
        return "fitted" if key == FITTED_TO else "compared"

    def as_dict(self) -> dict[str, Any]:
        return {"model": self.checkpoint.model, "weights": self.checkpoint.weights, "kv_layout": self.kv_layout,
                "kv_bytes_per_token": self.kv_bytes_per_token, "tokens": self.tokens,
                "published_tokens": self.published_tokens, "role": self.role}


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
    return every_layer.kv_bytes_per_token("fp8", token_scales=False)


def scenarios() -> list[Scenario]:
    kimi_cfg = ModelConfig.from_hf(PRESETS["kimi-k2.6"].config)
    glm_cfg = ModelConfig.from_hf(PRESETS["glm-5.2"].config)
    kimi = checkpoint("kimi-k2.6", "INT4", published_gib=553)
    glm_int4 = checkpoint("glm-5.2", "INT4", published_gib=421)
    glm_fp8 = checkpoint("glm-5.2", "FP8", published_gib=705)
    glm_published = published_glm_kv_bytes(glm_cfg, MTP_LAYERS["glm-5.2"])
    with_indexer = f"FP8 + indexer, {glm_cfg.num_hidden_layers + MTP_LAYERS['glm-5.2']} layers"
    return [
        Scenario(kimi, BF16, kimi_cfg.kv_bytes_per_token("bf16"), 686_000),
        Scenario(kimi, FP8_PER_TENSOR, kimi_cfg.kv_bytes_per_token("fp8", token_scales=False), 1_372_000),
        Scenario(kimi, FP8_NANO, kimi_cfg.kv_bytes_per_token("fp8"), None),
        Scenario(glm_int4, with_indexer, glm_published, 1_180_000),
        Scenario(glm_fp8, with_indexer, glm_published, 500_000),
        Scenario(glm_int4, FP8_NANO, glm_cfg.kv_bytes_per_token("fp8"), None),
    ]


def fp8_token_ratios(scenarios: list[Scenario]) -> dict[str, float]:
    """Kimi's FP8 tokens over its BF16 tokens: 2 with a per-tensor scale, 1152 / 580 = 1.986 with nano's."""
    kimi = {s.kv_layout: s.tokens for s in scenarios if s.checkpoint.model == "kimi-k2.6"}
    return {"per_tensor": kimi[FP8_PER_TENSOR] / kimi[BF16], "nano": kimi[FP8_NANO] / kimi[BF16]}


def fitted_budget_gib() -> float:
    """The budget that makes FITTED_TO come out exactly: its checkpoint's share of a GPU + its tokens' KV bytes.
    BUDGET_GIB is this number rounded; a test keeps them in step when a preset changes."""
    model, weights, layout, tokens = FITTED_TO
    scenario = next(s for s in scenarios() if (s.checkpoint.model, s.checkpoint.weights, s.kv_layout) ==
                    (model, weights, layout))
    return (scenario.checkpoint.weights_per_gpu_bytes + tokens * scenario.kv_bytes_per_token) / GIB


def layout_facts() -> dict[str, int]:
    """The numbers the printed notes quote, read from the configs: Kimi's latent + rope values per token per
    layer and the bytes of nano's FP8 scale beside them; GLM-5.2's indexer layers and MTP layers."""
    kimi = ModelConfig.from_hf(PRESETS["kimi-k2.6"].config)
    glm = ModelConfig.from_hf(PRESETS["glm-5.2"].config)
    scale_bytes = (kimi.kv_bytes_per_token("fp8") - kimi.kv_bytes_per_token("fp8", token_scales=False)) \
        // kimi.num_hidden_layers
    return {"kimi_values_per_token_layer": kimi.kv_values_per_token_layer, "fp8_scale_bytes": scale_bytes,
            "glm_indexer_layers": len(glm.indexer_layers), "glm_mtp_layers": MTP_LAYERS["glm-5.2"]}


def inputs() -> dict[str, Any]:
    gpu_gib = GPU_MEMORY_MIB / 1024
    return {"gpus": GPUS, "gpu": "H200", "gpu_memory_mib": GPU_MEMORY_MIB, "gpu_memory_gib": round(gpu_gib, 2),
            "tensor_parallel": GPUS, "budget_gib": BUDGET_GIB, "budget_fraction": round(BUDGET_GIB / gpu_gib, 4),
            "budget_source": BUDGET_SOURCE}
