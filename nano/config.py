"""Model configuration: one dataclass for every MLA + MoE family nano serves.

`ModelConfig.from_hf` reads a Hugging Face `config.json` dict of any supported `model_type` and normalises the
differences between families (legacy `rope_scaling` vs `rope_parameters`, Kimi K2.5's `text_config`, GLM-5's
per-layer indexer and MLP patterns). Values that follow from others are properties.
"""
from __future__ import annotations

import json
import math
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

from nano.errors import NanoError


def read_json(file: Path, missing: str | None = None) -> dict[str, Any]:
    """A checkpoint's JSON settings file as a dict: {} when it is absent, or NanoError(`missing`) when that is
    given (a file that must be there)."""
    if not file.is_file():
        if missing:
            raise NanoError(missing)
        return {}
    try:
        data = json.loads(file.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError, RecursionError) as err:   # RecursionError: nesting
        raise NanoError(f"cannot read {file}: {err}") from None
    if not isinstance(data, dict):
        raise NanoError(f"{file} must hold a JSON object")
    return data


TILES = 4   # power-of-two scales per latent in the FP8 tile layout: FlashMLA's 128-value tiles of the 512-value latent
            # (nano/kv.py); a smaller model's latent is cut in quarters too
# model_type -> the architecture family nano runs it as.
SUPPORTED_MODEL_TYPES = {
    "deepseek_v3": "kimi",     # Kimi K2 / K2-Thinking, Moonlight, DeepSeek-V3
    "kimi_k2": "kimi",         # Kimi's own name for the same architecture
    "kimi_k25": "kimi",        # Kimi K2.5 / K2.6: a deepseek_v3 text model inside `text_config`
    "glm_moe_dsa": "glm",      # GLM-5.x: MLA + DeepSeek Sparse Attention indexer
    "glm4_moe_lite": "glm",    # GLM-4.7-Flash: MLA without the indexer
}


@dataclass(frozen=True)
class ModelConfig:
    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int            # dense MLP width (the first layers)
    moe_intermediate_size: int        # width of one routed / shared expert
    num_hidden_layers: int
    num_attention_heads: int
    # MLA
    q_lora_rank: int | None           # None: queries come from one q_proj (Moonlight)
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    # MoE
    n_routed_experts: int
    num_experts_per_tok: int
    n_shared_experts: int
    n_group: int
    topk_group: int
    routed_scaling_factor: float
    norm_topk_prob: bool
    mlp_layer_types: list[str]        # "dense" | "sparse" per layer
    # positions and norms
    rms_norm_eps: float
    max_position_embeddings: int
    rope_theta: float
    rope_scaling: dict[str, Any] | None   # YaRN parameters, None for plain RoPE
    rope_interleave: bool
    # DeepSeek Sparse Attention (GLM-5.x); indexer_types is None when the model has no indexer
    indexer_types: list[str] | None = None
    index_topk: int = 0
    index_head_dim: int = 0
    index_n_heads: int = 0
    # the indexer's own RoPE layout, independent of MLA's `rope_interleave`: GLM-5 interleaves both (transformers'
    # GlmMoeDsaIndexer); DeepSeek-V3.2 interleaves MLA's but splits the indexer's in halves (DeepseekV32Indexer)
    indexer_rope_interleave: bool = True
    # misc
    attention_bias: bool = False
    tie_word_embeddings: bool = False
    bos_token_id: int | None = None
    eos_token_ids: list[int] = field(default_factory=list)
    weight_prefix: str = ""                          # "language_model." for Kimi K2.5 / K2.6
    quantization_config: dict[str, Any] | None = None

    # ---- derived values -------------------------------------------------------------------------------------
    @property
    def family(self) -> str:
        return SUPPORTED_MODEL_TYPES[self.model_type]

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def has_indexer(self) -> bool:
        return self.indexer_types is not None

    @property
    def yarn_mscale(self) -> float:
        """YaRN's attention-temperature correction; its square multiplies the softmax scale (Kimi: 2.0047 at x64)."""
        if not self.rope_scaling:
            return 1.0
        factor, mscale_all_dim = self.rope_scaling["factor"], self.rope_scaling.get("mscale_all_dim") or 0
        if not mscale_all_dim or factor <= 1:
            return 1.0
        return 0.1 * mscale_all_dim * math.log(factor) + 1.0

    @property
    def softmax_scale(self) -> float:
        return self.qk_head_dim ** -0.5 * self.yarn_mscale ** 2

    @property
    def kv_values_per_token_layer(self) -> int:
        """What MLA caches per token per layer: the normalised latent and the rotated rope key (512 + 64 = 576)."""
        return self.kv_lora_rank + self.qk_rope_head_dim

    @property
    def indexer_layers(self) -> list[int]:
        """Layers that run (and cache keys for) the DSA indexer; "shared" layers reuse the last full layer's pick."""
        return [i for i, t in enumerate(self.indexer_types or []) if t == "full"]

    def kv_bytes_per_token(self, kv_dtype: str = "bf16", kv_layout: str = "token") -> int:
        """Bytes of KV cache one token needs across all layers: the latent + rope key, plus the indexer key on
        GLM-5's indexer layers. FP8 lays the latent ‖ rope key out as `kv_layout` (nano/kv.py): `token` adds one
        fp32 scale per token per layer (C + R + 4), `tensor` one scale for the whole layer (C + R: the published
        arithmetic), `tile` keeps the rope key in BF16 and gives each quarter of the latent a scale (C + 4·4 + 2R:
        FlashMLA's 656 B, a scale per 128 values). The FP8 indexer key always has its own scale (Di + 4: DeepSeek
        V3.2's layout)."""
        element = {"fp32": 4, "bf16": 2, "fp8": 1}[kv_dtype]
        c, r = self.kv_lora_rank, self.qk_rope_head_dim
        latent = (c + r) * element
        if kv_dtype == "fp8":
            latent = {"token": c + r + 4, "tensor": c + r, "tile": c + 4 * TILES + 2 * r}[kv_layout]
        index_key = self.index_head_dim * element + (4 if kv_dtype == "fp8" else 0)
        return self.num_hidden_layers * latent + len(self.indexer_layers) * index_key

    def num_parameters(self, active_only: bool = False) -> int:
        """Parameter count computed from the dimensions (routed experts counted top-k times when active_only)."""
        h, heads = self.hidden_size, self.num_attention_heads
        q = (h * self.q_lora_rank + self.q_lora_rank + self.q_lora_rank * heads * self.qk_head_dim
             if self.q_lora_rank else h * heads * self.qk_head_dim)
        kv = h * self.kv_values_per_token_layer + self.kv_lora_rank \
            + self.kv_lora_rank * heads * (self.qk_nope_head_dim + self.v_head_dim)
        attn = q + kv + heads * self.v_head_dim * h + 2 * h
        expert = 3 * h * self.moe_intermediate_size
        routed = self.num_experts_per_tok if active_only else self.n_routed_experts
        moe = routed * expert + self.n_shared_experts * expert + self.n_routed_experts * (h + 1)
        total = self.vocab_size * h * (1 if self.tie_word_embeddings else 2) + h
        for i, kind in enumerate(self.mlp_layer_types):
            total += attn + (3 * h * self.intermediate_size if kind == "dense" else moe)
            if self.has_indexer and self.indexer_types[i] == "full":
                total += (self.q_lora_rank * self.index_n_heads * self.index_head_dim + h * self.index_head_dim
                          + 2 * self.index_head_dim + h * self.index_n_heads)
        return total

    # ---- parsing --------------------------------------------------------------------------------------------
    @classmethod
    def from_hf(cls, raw: dict[str, Any]) -> "ModelConfig":
        """Build from a Hugging Face config.json dict; raises NanoError naming what is unsupported or missing."""
        model_type = raw.get("model_type")
        if model_type not in SUPPORTED_MODEL_TYPES:
            raise NanoError(f"unsupported model_type {model_type!r}; nano supports: "
                            f"{', '.join(sorted(SUPPORTED_MODEL_TYPES))}")
        outer, prefix = raw, ""
        if model_type == "kimi_k25":  # the language model sits in text_config; its weights under language_model.
            raw, prefix = raw.get("text_config") or {}, "language_model."
        try:
            return cls._parse(model_type, raw, outer, prefix)
        except KeyError as missing:
            raise NanoError(f"config.json is missing the field {missing.args[0]!r} that {model_type} needs") from None
        except (TypeError, ValueError) as bad:
            raise NanoError(f"config.json has an invalid value: {bad}") from None

    @classmethod
    def _parse(cls, model_type: str, raw: dict, outer: dict, prefix: str) -> "ModelConfig":
        """The fields as config.json gives them; `validate` checks their types and ranges (no value is coerced:
        "4096" or 4096.7 is no vocabulary size)."""
        layers = raw["num_hidden_layers"]
        _check_count("num_hidden_layers", layers)   # before anything loops over the layers
        theta, scaling = cls._rope_parameters(raw)
        mlp_types, indexer_types = cls._layer_types(model_type, raw, layers)
        eos = raw.get("eos_token_id", outer.get("eos_token_id"))
        cfg = cls(
            model_type=model_type,
            vocab_size=raw["vocab_size"],
            hidden_size=raw["hidden_size"],
            intermediate_size=raw["intermediate_size"],
            moe_intermediate_size=raw["moe_intermediate_size"],
            num_hidden_layers=layers,
            num_attention_heads=raw["num_attention_heads"],
            q_lora_rank=raw.get("q_lora_rank"),
            kv_lora_rank=raw["kv_lora_rank"],
            qk_nope_head_dim=raw["qk_nope_head_dim"],
            qk_rope_head_dim=raw["qk_rope_head_dim"],
            v_head_dim=raw["v_head_dim"],
            n_routed_experts=_given(raw, "n_routed_experts", "num_experts", default=0),
            num_experts_per_tok=raw["num_experts_per_tok"],
            n_shared_experts=_given(raw, "n_shared_experts", default=0),
            n_group=_given(raw, "n_group", default=1),
            topk_group=_given(raw, "topk_group", default=1),
            routed_scaling_factor=raw.get("routed_scaling_factor", 1.0),
            norm_topk_prob=raw.get("norm_topk_prob", True),
            mlp_layer_types=mlp_types,
            rms_norm_eps=raw.get("rms_norm_eps", 1e-6),
            max_position_embeddings=raw["max_position_embeddings"],
            rope_theta=theta,
            rope_scaling=scaling,
            rope_interleave=raw.get("rope_interleave", True),
            indexer_types=indexer_types,
            index_topk=raw.get("index_topk", 2048) if indexer_types else 0,
            index_head_dim=raw.get("index_head_dim", 128) if indexer_types else 0,
            index_n_heads=raw.get("index_n_heads", 32) if indexer_types else 0,
            indexer_rope_interleave=raw.get("indexer_rope_interleave", True),   # nano's key (HF has none)
            attention_bias=raw.get("attention_bias", False),
            tie_word_embeddings=outer.get("tie_word_embeddings", raw.get("tie_word_embeddings", False)),
            bos_token_id=raw.get("bos_token_id", outer.get("bos_token_id")),
            eos_token_ids=eos if isinstance(eos, list) else [] if eos is None else [eos],
            weight_prefix=prefix,
            quantization_config=raw.get("quantization_config") or outer.get("quantization_config"),
        )
        cfg.validate()
        return cfg

    @staticmethod
    def _rope_parameters(raw: dict) -> tuple[float, dict[str, Any] | None]:
        """RoPE's theta and YaRN's parameters (None for plain RoPE), from `rope_parameters` or the legacy
        `rope_scaling`. YaRN's factor must be at least 1, as transformers requires."""
        rope = dict(raw.get("rope_parameters") or raw.get("rope_scaling") or {})
        rope_type = rope.get("rope_type", rope.get("type", "default"))
        theta = rope.get("rope_theta", raw.get("rope_theta", 10000.0))
        if rope_type == "default":
            return theta, None
        if rope_type != "yarn":
            raise NanoError(f"unsupported RoPE type {rope_type!r} (nano supports default and yarn)")
        scaling = {k: rope.get(k) for k in ("factor", "original_max_position_embeddings", "beta_fast", "beta_slow",
                                            "mscale", "mscale_all_dim", "attention_factor")}
        original = raw.get("original_max_position_embeddings", scaling["original_max_position_embeddings"])
        scaling["original_max_position_embeddings"] = raw["max_position_embeddings"] if original is None else original
        _check_count("original_max_position_embeddings", scaling["original_max_position_embeddings"])
        if scaling["factor"] is None:
            scaling["factor"] = raw["max_position_embeddings"] / scaling["original_max_position_embeddings"]
        bad = [k for k, v in scaling.items() if v is not None and (not _is_number(v) or k == "factor" and v < 1)]
        if bad:
            raise NanoError(f"config.json: YaRN's {bad[0]} must be a finite number{' >= 1' * (bad[0] == 'factor')}, "
                            f"got {scaling[bad[0]]!r}")
        scaling["truncate"] = rope.get("truncate", True)
        return theta, scaling

    @staticmethod
    def _layer_types(model_type: str, raw: dict, layers: int) -> tuple[list[str], list[str] | None]:
        """Each layer's MLP ("dense" | "sparse") and, for GLM-5's indexer, its kind ("full" | "shared"; None: no
        indexer), from the explicit lists or from the patterns older configs give."""
        if raw.get("mlp_layer_types"):
            mlp_types = list(raw["mlp_layer_types"])
        else:
            first_dense = raw.get("first_k_dense_replace")
            if first_dense is None:
                first_dense = 1 if model_type == "glm4_moe_lite" else 3
            mlp_types = ["dense" if i < first_dense else "sparse" for i in range(layers)]
        if len(mlp_types) != layers or set(mlp_types) - {"dense", "sparse"}:
            raise NanoError(f"mlp_layer_types must list 'dense'/'sparse' for each of the {layers} layers")
        if model_type != "glm_moe_dsa":
            return mlp_types, None
        indexer_types = raw.get("indexer_types")
        if not indexer_types:
            pattern = raw.get("index_topk_pattern")
            if pattern is not None:
                indexer_types = [{"F": "full", "S": "shared"}[c] for c in pattern] \
                    if isinstance(pattern, str) else list(pattern)
            else:
                freq = max(raw.get("index_topk_freq", 1), 1)
                offset = raw.get("index_skip_topk_offset", 2)
                indexer_types = ["full" if max(i - offset + 1, 0) % freq == 0 else "shared" for i in range(layers)]
        if len(indexer_types) != layers or indexer_types[0] != "full":
            raise NanoError("indexer_types must give one entry per layer and start with 'full'")
        return mlp_types, indexer_types

    def validate(self) -> None:
        """Every size, count and scale in range before anything is allocated; an error names the config.json
        field. The upper limits are far beyond any released model (Kimi K2.6: 61 layers, 384 experts) and only stop
        a typo from hanging the machine. Each field must have its declared type (a bool is no integer)."""
        for spec in fields(self):   # the declared type's name, e.g. "int" of "int | None", "list" of "list[str]"
            value, (kind, what) = getattr(self, spec.name), _KINDS[spec.type.split("[")[0].split(" ")[0]]
            is_kind = isinstance(value, kind) and isinstance(value, bool) == (kind is bool)
            if not is_kind and not (value is None and spec.type.endswith("| None")):
                raise NanoError(f"config.json: {spec.name} must be {what}, got {value!r}")
        sparse = "sparse" in self.mlp_layer_types
        positive = ["vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "kv_lora_rank",
                    "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim", "max_position_embeddings"]
        positive += ["intermediate_size"] if "dense" in self.mlp_layer_types else []
        positive += ["moe_intermediate_size", "n_routed_experts", "num_experts_per_tok", "n_group", "topk_group"] \
            if sparse else []
        positive += ["q_lora_rank"] if self.q_lora_rank is not None else []
        positive += ["index_topk", "index_head_dim", "index_n_heads"] if self.has_indexer else []
        for name in positive:
            _check_count(name, getattr(self, name))
        if not 0 <= self.n_shared_experts <= _LIMITS["n_routed_experts"]:
            raise NanoError(f"config.json: n_shared_experts must be >= 0, got {self.n_shared_experts}")
        for name in ("rms_norm_eps", "rope_theta", "routed_scaling_factor"):
            if not (_is_number(getattr(self, name)) and getattr(self, name) > 0):
                raise NanoError(f"config.json: {name} must be a positive number, got {getattr(self, name)}")
        if sparse:
            if self.n_routed_experts < self.num_experts_per_tok:
                raise NanoError(f"config.json: num_experts_per_tok={self.num_experts_per_tok} does not fit "
                                f"n_routed_experts={self.n_routed_experts}")
            if self.n_routed_experts % self.n_group or self.topk_group > self.n_group:
                raise NanoError(f"config.json: n_group={self.n_group}, topk_group={self.topk_group} do not divide "
                                f"{self.n_routed_experts} experts")
        if self.qk_rope_head_dim % 2:
            raise NanoError("config.json: qk_rope_head_dim must be even")
        if self.has_indexer and self.index_head_dim < self.qk_rope_head_dim:
            raise NanoError(f"config.json: index_head_dim={self.index_head_dim} must hold the "
                            f"qk_rope_head_dim={self.qk_rope_head_dim} rotated dimensions")
        for name, ids in (("bos_token_id", [] if self.bos_token_id is None else [self.bos_token_id]),
                          ("eos_token_id", self.eos_token_ids)):
            bad = [i for i in ids if not is_token_id(i, self.vocab_size)]
            if bad:
                raise NanoError(f"config.json: {name} {bad[0]!r} is not a token id of the {self.vocab_size:,}-token "
                                f"vocabulary")


# The largest value each count may take (sizes and dimensions not named here: 2**20).
_LIMITS = {"num_hidden_layers": 1024, "num_attention_heads": 1024, "n_routed_experts": 16384, "index_n_heads": 1024,
           "vocab_size": 1 << 24, "max_position_embeddings": 1 << 24}


_KINDS = {"int": (int, "an integer"), "float": ((int, float), "a number"), "bool": (bool, "true or false"),
          "str": (str, "a string"), "list": (list, "a list"), "dict": (dict, "an object")}


def _check_count(name: str, value: Any) -> None:
    limit = _LIMITS.get(name, 1 << 20)
    if not (isinstance(value, int) and not isinstance(value, bool) and 1 <= value <= limit):
        raise NanoError(f"config.json: {name} must be an integer from 1 to {limit:,}, got {value!r}")


def _given(raw: dict[str, Any], *keys: str, default: int) -> Any:
    """The first of `keys` that config.json gives a value other than null, else `default`."""
    return next((raw[key] for key in keys if raw.get(key) is not None), default)


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def is_token_id(value: Any, vocab_size: int) -> bool:
    """Whether `value` is an integer id of a `vocab_size`-token vocabulary (a bool is not)."""
    return isinstance(value, int) and not isinstance(value, bool) and 0 <= value < vocab_size
