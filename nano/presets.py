"""Named presets: the published dimensions of the models nano exists for, and their `nano` stand-ins.

A preset resolves to the real checkpoint when one is available (``--weights DIR`` or the local Hugging Face
cache). Otherwise `glm-5.2` and `kimi-k2.6` run their *trained* stand-ins (TRAINED_BODY, trained on Shakespeare by
tools/train_standin.py and shipped in nano/standins/), and every other preset — and `<preset>-random` for any —
a *random-weight* stand-in of the same architecture (`nano_config`): MLA, the DSA indexer for GLM-5, YaRN for
Kimi, shared + routed experts, dense first layers, seeded random weights and a byte-level tokenizer, larger and
meant for speed experiments.
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from nano.config import SUPPORTED_MODEL_TYPES
from nano.errors import NanoError
from nano.tokenizer import byte_vocab_size

RANDOM_SUFFIX = "-random"   # `<preset>-random`: the preset's random-weight stand-in
_HUB_ID = re.compile(r"[A-Za-z0-9][\w.-]*/[\w.-]+")


@dataclass(frozen=True)
class Preset:
    name: str
    hub_id: str                  # where the real checkpoint lives
    description: str
    config: dict[str, Any]       # the real config.json fields nano reads (published values)
    nano_config: dict[str, Any]  # the same architecture, shrunk


_KIMI_YARN = {"rope_type": "yarn", "rope_theta": 50000.0, "factor": 64.0, "original_max_position_embeddings": 4096,
              "beta_fast": 1.0, "beta_slow": 1.0, "mscale": 1.0, "mscale_all_dim": 1.0}
_INT4_EXPERTS = {"quant_method": "compressed-tensors", "format": "pack-quantized",
                 "config_groups": {"group_0": {"targets": ["Linear"], "weights": {
                     "num_bits": 4, "type": "int", "strategy": "group", "group_size": 32, "symmetric": True}}},
                 "ignore": ["lm_head", "re:.*self_attn.*", "re:.*shared_experts.*", "re:.*mlp\\.(gate|up|down)_proj.*"]}

# What the four share: MLA with a 512 + 64 latent, one expert group, normalised top-k weights; then what each family
# shares: vocabulary, head dims, special tokens. (num_key_value_heads, always the head count, nano does not read.)
_MLA_MOE = dict(kv_lora_rank=512, qk_rope_head_dim=64, n_group=1, topk_group=1, norm_topk_prob=True, rms_norm_eps=1e-5)
_KIMI = dict(_MLA_MOE, model_type="deepseek_v3", vocab_size=163840, qk_nope_head_dim=128, v_head_dim=128,
             first_k_dense_replace=1, bos_token_id=163584, eos_token_id=163586)
_GLM = dict(_MLA_MOE, vocab_size=154880, qk_nope_head_dim=192, v_head_dim=256, n_shared_experts=1,
            eos_token_id=[154820, 154827, 154829], tie_word_embeddings=False)

KIMI_K26 = dict(
    _KIMI, hidden_size=7168, intermediate_size=18432, moe_intermediate_size=2048, num_hidden_layers=61,
    num_attention_heads=64, q_lora_rank=1536, n_routed_experts=384, num_experts_per_tok=8, n_shared_experts=1,
    routed_scaling_factor=2.827, max_position_embeddings=262144, rope_scaling=_KIMI_YARN, tie_word_embeddings=False,
    quantization_config=_INT4_EXPERTS)

MOONLIGHT = dict(
    _KIMI, hidden_size=2048, intermediate_size=11264, moe_intermediate_size=1408, num_hidden_layers=27,
    num_attention_heads=16, q_lora_rank=None, n_routed_experts=64, num_experts_per_tok=6, n_shared_experts=2,
    routed_scaling_factor=2.446, max_position_embeddings=8192, rope_theta=50000.0)

GLM52 = dict(
    _GLM, model_type="glm_moe_dsa", hidden_size=6144, intermediate_size=12288, moe_intermediate_size=2048,
    num_hidden_layers=78, num_attention_heads=64, q_lora_rank=2048, n_routed_experts=256, num_experts_per_tok=8,
    routed_scaling_factor=2.5, first_k_dense_replace=3, max_position_embeddings=1048576,
    rope_parameters={"rope_type": "default", "rope_theta": 8e6},
    index_topk=2048, index_head_dim=128, index_n_heads=32, index_topk_freq=4, index_skip_topk_offset=3,
    quantization_config={"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                         "weight_block_size": [128, 128]})

GLM47_FLASH = dict(
    _GLM, model_type="glm4_moe_lite", hidden_size=2048, intermediate_size=10240, moe_intermediate_size=1536,
    num_hidden_layers=47, num_attention_heads=20, q_lora_rank=768, n_routed_experts=64, num_experts_per_tok=4,
    routed_scaling_factor=1.8, first_k_dense_replace=1, max_position_embeddings=202752,
    rope_parameters={"rope_type": "default", "rope_theta": 1e6})

# The nano stand-ins share one body (and a byte-level vocabulary: 256 bytes + the family's special tokens): ~100M
# parameters, ~34M active per token. Like the real models they route 8 experts per token and have one dense first
# layer, so a MoE layer's bytes split as Kimi K2.6's do (routed experts ~70%, attention + shared expert ~30%):
# what INT4 experts save is in proportion. Small enough for >= 20 tokens/s on two CPU cores.
_NANO_BODY = dict(
    hidden_size=512, intermediate_size=1024, moe_intermediate_size=256, num_hidden_layers=8,
    num_attention_heads=8, num_key_value_heads=8, q_lora_rank=256, kv_lora_rank=128, qk_nope_head_dim=64,
    qk_rope_head_dim=32, v_head_dim=64, n_routed_experts=32, num_experts_per_tok=8, n_shared_experts=1,
    n_group=1, topk_group=1, norm_topk_prob=True, first_k_dense_replace=1, rms_norm_eps=1e-5,
    max_position_embeddings=4096, tie_word_embeddings=False)


# The trained stand-ins (tools/train_standin.py, shipped in nano/standins/): ~10M parameters, small enough to train
# in under an hour on one CPU core and to ship at under 25 MB in bf16, with the proportions that matter for INT4:
# 8 of 32 routed experts per token, one dense first layer, routed experts most of a MoE layer's bytes.
TRAINED_BODY = dict(
    hidden_size=256, intermediate_size=768, moe_intermediate_size=96, num_hidden_layers=4,
    num_attention_heads=4, num_key_value_heads=4, q_lora_rank=128, kv_lora_rank=64, qk_nope_head_dim=32,
    qk_rope_head_dim=16, v_head_dim=32, n_routed_experts=32, num_experts_per_tok=8, n_shared_experts=1,
    first_k_dense_replace=1, index_head_dim=32, index_n_heads=4)


def _nano(real: dict[str, Any], **overrides: Any) -> dict[str, Any]:
    keep = {k: real[k] for k in ("model_type", "routed_scaling_factor", "rope_scaling", "rope_parameters",
                                 "rope_theta") if k in real}
    family = SUPPORTED_MODEL_TYPES[real["model_type"]]
    return {**_NANO_BODY, **keep, "vocab_size": byte_vocab_size(family), **overrides}


PRESETS: dict[str, Preset] = {p.name: p for p in [
    Preset("kimi-k2.6", "moonshotai/Kimi-K2.6", "Kimi K2.6: 1T-param DeepSeek-V3 MoE, INT4 routed experts",
           KIMI_K26, _nano(KIMI_K26, max_position_embeddings=8192,
                           rope_scaling={**_KIMI_YARN, "factor": 32.0, "original_max_position_embeddings": 256})),
    Preset("glm-5.2", "zai-org/GLM-5.2", "GLM-5.2: 744B MLA + DSA-indexer MoE, FP8 release",
           GLM52, _nano(GLM52, index_topk=64, index_head_dim=64, index_n_heads=8, index_topk_freq=2,
                        index_skip_topk_offset=2)),
    Preset("glm-4.7-flash", "zai-org/GLM-4.7-Flash", "GLM-4.7-Flash: 30B-A3B MLA MoE (GLM-5 proxy, no indexer)",
           GLM47_FLASH, _nano(GLM47_FLASH)),
    Preset("moonlight-16b", "moonshotai/Moonlight-16B-A3B-Instruct",
           "Moonlight 16B-A3B: Kimi tokenizer and router, MLA without q_lora", MOONLIGHT,
           _nano(MOONLIGHT, q_lora_rank=None, n_shared_experts=2)),
]}


def find_preset(name: str) -> tuple[Preset | None, bool]:
    """The preset a model name names (None: none), and whether it asks for the random-weight stand-in."""
    random_weights = name.endswith(RANDOM_SUFFIX) and name.removesuffix(RANDOM_SUFFIX) in PRESETS
    return PRESETS.get(name.removesuffix(RANDOM_SUFFIX) if random_weights else name), random_weights


def check_model_name(name: str) -> None:
    """Refuse a model name that is no preset, no existing path and no Hugging Face repo id. No file is read (nor
    torch loaded): the command line checks this first; `nano.loader.resolve_model` then finds the model."""
    if find_preset(name)[0] is not None or Path(name).expanduser().exists() or _HUB_ID.fullmatch(name):
        return
    if "/" in name or name.startswith((".", "~")):
        raise NanoError(f"no such model directory: {name}")
    raise NanoError(f"unknown model {name!r}: not a preset ({', '.join(PRESETS)}, each also as "
                    f"<preset>{RANDOM_SUFFIX}), a local directory or a Hugging Face repo id org/name")
