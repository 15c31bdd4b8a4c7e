"""Loading tiny real-format checkpoints (plain, sharded, FP8 block, INT4, Kimi K2.5 layout) into nano's model,
and every kind of bad input reaching the user as one NanoError line."""
import json
import math
import os
import re
import shutil
from pathlib import Path

import huggingface_hub
import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from fixtures import (convert_to_fp8_block, convert_to_int4_ct, make_checkpoint, make_kimi_k25, read_tensors,
                      reference_state_dict, shard, write_checkpoint)
from fixtures import read_config as read_raw_config
from nano.config import ModelConfig
from nano.errors import NanoError
from nano.llm import resolve_config
from nano.loader import Resolved, load_weights, read_config, resolve_model
from nano.model import Transformer
from nano.quant import Fp8Linear, Int4Linear
from nano.presets import PRESETS

ROUTER = ("mlp.gate.weight", "e_score_correction_bias")


def load(ckpt: Path, dtype: torch.dtype = torch.float32, progress: bool = False,
         materialize: bool = True) -> Transformer:
    cfg = ModelConfig.from_hf(read_config(ckpt))
    model = Transformer(cfg, dtype=dtype, materialize=materialize)
    load_weights(model, ckpt, cfg, progress=progress)
    return model


def loaded_state(model: Transformer) -> dict[str, torch.Tensor]:
    """The model's tensors by checkpoint name; INT4 and FP8 layers (kept quantized as loaded) give their dequantized
    weight (and their bias, if any, as it is)."""
    packed = {name: module for name, module in model.named_modules() if isinstance(module, (Int4Linear, Fp8Linear))}
    state = {k: v for k, v in model.state_dict().items()
             if k.rpartition(".")[0] not in packed or k.endswith(".bias")}
    return {**state, **{f"{name}.weight": module.dequantized() for name, module in packed.items()}}


def assert_loaded(model: Transformer, reference: dict[str, torch.Tensor]) -> None:
    """Every model tensor holds exactly the reference value, cast to the tensor's own dtype."""
    state = loaded_state(model)
    if model.cfg.tie_word_embeddings:
        reference = {**reference, "lm_head.weight": reference["model.embed_tokens.weight"]}
    assert set(state) == set(reference)
    for name, value in state.items():
        torch.testing.assert_close(value, reference[name].to(value.dtype), rtol=0, atol=0, msg=name)


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("ckpts")
    return {model_type: make_checkpoint(root / model_type, model_type)
            for model_type in ("deepseek_v3", "glm_moe_dsa", "glm4_moe_lite")}


def rewrite(src: Path, dst: Path, edit) -> Path:
    """Copy a one-file checkpoint with `edit(tensors)` applied."""
    tensors = read_tensors(src)
    edit(tensors)
    return write_checkpoint(dst, tensors, read_raw_config(src), src)


# ---- loading ----------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("model_type", ["deepseek_v3", "glm_moe_dsa", "glm4_moe_lite"])
def test_plain_checkpoint_loads_exactly(ckpts, model_type):
    assert_loaded(load(ckpts[model_type]), reference_state_dict(ckpts[model_type]))


def test_bf16_model_casts_but_keeps_router_fp32(ckpts):
    model = load(ckpts["deepseek_v3"], dtype=torch.bfloat16)
    for name, value in model.state_dict().items():
        assert value.dtype == (torch.float32 if name.endswith(ROUTER) else torch.bfloat16), name
    assert_loaded(model, reference_state_dict(ckpts["deepseek_v3"]))


def test_bf16_checkpoint_into_fp32_model(tmp_path):
    ckpt = make_checkpoint(tmp_path / "bf16", "glm4_moe_lite", dtype=torch.bfloat16)
    assert_loaded(load(ckpt), reference_state_dict(ckpt))


@pytest.mark.parametrize("materialize", [True, False])
def test_sharded_fp8_checkpoint_stays_fp8(ckpts, tmp_path, materialize):
    """The GLM-5 FP8 layout loads FP8-resident: each quantized Linear keeps the checkpoint's e4m3 codes and block
    scales bit for bit (kv_b_proj, read by MLA as a matrix, is dequantized); with `materialize=False` nothing is
    ever allocated in the model's dtype for them, so the model's tensors are exactly the FP8 ones plus the rest."""
    reference = convert_to_fp8_block(ckpts["glm_moe_dsa"], tmp_path / "fp8")
    sharded = shard(tmp_path / "fp8", tmp_path / "sharded", 3)
    assert len(list(sharded.glob("*.safetensors"))) == 3
    model = load(sharded, dtype=torch.bfloat16, materialize=materialize)
    assert_loaded(model, reference)
    stored = read_tensors(tmp_path / "fp8")
    fp8 = {name for name, module in model.named_modules() if isinstance(module, Fp8Linear)}
    assert {f"{name}.weight" for name in fp8} == {n for n, t in stored.items()
                                                  if t.dtype == torch.float8_e4m3fn and "kv_b_proj" not in n}
    state = model.state_dict()
    for name in fp8:
        assert torch.equal(state[f"{name}.weight"].view(torch.uint8), stored[f"{name}.weight"].view(torch.uint8))
        assert torch.equal(state[f"{name}.weight_scale_inv"], stored[f"{name}.weight_scale_inv"])
    assert not any(t.is_meta for t in state.values())
    held = sum(t.numel() * t.element_size() for t in state.values() if t.dtype == torch.float8_e4m3fn)
    assert held == sum(stored[f"{name}.weight"].numel() for name in fp8)       # one byte per FP8 weight
    # the dense MLP (192 wide) spans a full and a partial 128-block
    raw = read_tensors(tmp_path / "fp8")
    assert raw["model.layers.0.mlp.down_proj.weight_scale_inv"].shape == (1, 2)
    assert raw["model.layers.0.mlp.down_proj.weight"].dtype == torch.float8_e4m3fn


def test_fp8_respects_weight_block_size(ckpts, tmp_path):
    reference = convert_to_fp8_block(ckpts["glm4_moe_lite"], tmp_path / "fp8", block=(64, 32))
    assert read_tensors(tmp_path / "fp8")["model.layers.0.mlp.down_proj.weight_scale_inv"].shape == (1, 6)
    assert_loaded(load(tmp_path / "fp8"), reference)


def test_fp8_values_are_close_to_original(ckpts, tmp_path):
    convert_to_fp8_block(ckpts["glm_moe_dsa"], tmp_path / "fp8")
    original = reference_state_dict(ckpts["glm_moe_dsa"])
    for name, value in loaded_state(load(tmp_path / "fp8")).items():
        torch.testing.assert_close(value, original[name], rtol=0.07, atol=1e-3, msg=name)


def test_int4_routed_experts(ckpts, tmp_path):
    reference = convert_to_int4_ct(ckpts["deepseek_v3"], tmp_path / "int4")
    raw = read_tensors(tmp_path / "int4")
    assert raw["model.layers.1.mlp.experts.2.up_proj.weight_packed"].dtype == torch.int32
    assert "model.layers.1.mlp.shared_experts.up_proj.weight" in raw
    model = load(tmp_path / "int4")
    assert isinstance(model.get_submodule("model.layers.1.mlp.experts.2.up_proj"), Int4Linear)   # stays packed
    assert_loaded(model, reference)


def test_int4_group_size_from_config(ckpts, tmp_path):
    reference = convert_to_int4_ct(ckpts["glm4_moe_lite"], tmp_path / "int4", group_size=16)
    assert_loaded(load(tmp_path / "int4"), reference)


def test_kimi_k25_prefix_skips_vision_and_mtp(ckpts, tmp_path):
    reference = convert_to_int4_ct(ckpts["deepseek_v3"], tmp_path / "int4")
    make_kimi_k25(tmp_path / "int4", tmp_path / "k25")
    sharded = shard(tmp_path / "k25", tmp_path / "k25_sharded", 2)
    names = set(read_tensors(sharded))
    assert "vision_tower.patch_embed.proj.weight" in names and "language_model.model.layers.3.eh_proj.weight" in names
    cfg = ModelConfig.from_hf(read_config(sharded))
    assert cfg.weight_prefix == "language_model." and cfg.quantization_config["quant_method"] == "compressed-tensors"
    assert_loaded(load(sharded), reference)


def test_mtp_layer_and_rope_cache_are_skipped(ckpts, tmp_path):
    def add(tensors):
        tensors["model.layers.3.eh_proj.weight"] = torch.randn(64, 128)
        tensors["model.layers.3.self_attn.q_a_proj.weight"] = torch.randn(32, 64)
        tensors["model.layers.0.self_attn.rotary_emb.inv_freq"] = torch.randn(4)
    ckpt = rewrite(ckpts["glm4_moe_lite"], tmp_path / "mtp", add)
    assert_loaded(load(ckpt), reference_state_dict(ckpts["glm4_moe_lite"]))


@pytest.mark.parametrize("materialize", [True, False])
def test_tied_lm_head(tmp_path, materialize):
    ckpt = make_checkpoint(tmp_path / "tied", "deepseek_v3", tie_word_embeddings=True)
    assert "lm_head.weight" not in read_tensors(ckpt)
    model = load(ckpt, materialize=materialize)
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
    assert_loaded(model, reference_state_dict(ckpt))


def test_progress_bar_goes_to_stderr(ckpts, capfd):
    load(ckpts["glm4_moe_lite"], progress=True)
    assert capfd.readouterr().out == ""


# ---- bad checkpoints ------------------------------------------------------------------------------------------

def expect_error(ckpt: Path, pattern: str) -> NanoError:
    with pytest.raises(NanoError, match=pattern) as info:
        load(ckpt)
    assert "\n" not in str(info.value)
    return info.value


def test_shape_mismatch_names_tensor_and_shapes(ckpts, tmp_path):
    name = "model.layers.1.self_attn.q_a_proj.weight"
    ckpt = rewrite(ckpts["deepseek_v3"], tmp_path / "bad", lambda t: t.update({name: t[name][:, :63]}))
    expect_error(ckpt, rf"^tensor {name} has shape \(32, 63\) in the checkpoint but the config implies \(32, 64\)$")


def test_int4_shape_mismatch_uses_weight_shape(ckpts, tmp_path):
    convert_to_int4_ct(ckpts["deepseek_v3"], tmp_path / "int4")
    name = "model.layers.2.mlp.experts.0.down_proj"
    ckpt = rewrite(tmp_path / "int4", tmp_path / "bad",
                   lambda t: t.update({f"{name}.weight_shape": torch.tensor([64, 40])}))
    expect_error(ckpt, rf"tensor {name}.weight has shape \(64, 40\) in the checkpoint "
                       rf"but the config implies \(64, 32\)")


def test_missing_tensor(ckpts, tmp_path):
    name = "model.layers.2.mlp.experts.3.gate_proj.weight"
    ckpt = rewrite(ckpts["deepseek_v3"], tmp_path / "bad", lambda t: t.pop(name))
    expect_error(ckpt, rf"^checkpoint is missing 1 tensors, e.g. {name}$")


def test_missing_lm_head_when_untied(ckpts, tmp_path):
    ckpt = rewrite(ckpts["glm_moe_dsa"], tmp_path / "bad", lambda t: t.pop("lm_head.weight"))
    expect_error(ckpt, "missing 1 tensors, e.g. lm_head.weight")


def test_unexpected_tensor(ckpts, tmp_path):
    name = "model.layers.0.self_attn.q_norm.weight"
    ckpt = rewrite(ckpts["deepseek_v3"], tmp_path / "bad", lambda t: t.update({name: torch.ones(4)}))
    expect_error(ckpt, rf"^checkpoint has 1 tensors the model does not expect, e.g. {name}$")


def test_orphan_scale_is_unexpected(ckpts, tmp_path):
    name = "model.layers.0.mlp.bogus_proj.weight_scale_inv"
    ckpt = rewrite(ckpts["glm4_moe_lite"], tmp_path / "bad", lambda t: t.update({name: torch.ones(2, 1)}))
    expect_error(ckpt, f"does not expect, e.g. {name}")


def test_fp8_weight_without_scale(ckpts, tmp_path):
    convert_to_fp8_block(ckpts["glm4_moe_lite"], tmp_path / "fp8")
    name = "model.layers.0.self_attn.o_proj.weight"
    ckpt = rewrite(tmp_path / "fp8", tmp_path / "bad", lambda t: t.pop(f"{name}_scale_inv"))
    expect_error(ckpt, f"tensor {name} is FP8 but the checkpoint has no weight_scale_inv")


def test_int4_without_scale(ckpts, tmp_path):
    convert_to_int4_ct(ckpts["deepseek_v3"], tmp_path / "int4")
    name = "model.layers.1.mlp.experts.0.gate_proj"
    ckpt = rewrite(tmp_path / "int4", tmp_path / "bad", lambda t: t.pop(f"{name}.weight_scale"))
    expect_error(ckpt, f"INT4 tensor {name}.weight_packed has no {name}.weight_scale")


def test_int4_without_quantization_config(ckpts, tmp_path):
    convert_to_int4_ct(ckpts["deepseek_v3"], tmp_path / "int4")
    config = read_raw_config(tmp_path / "int4")
    del config["quantization_config"]
    (tmp_path / "int4" / "config.json").write_text(json.dumps(config))
    expect_error(tmp_path / "int4", "is packed INT4 but config.json has no compressed-tensors quantization_config")


def test_fp8_nan_code_is_refused(ckpts, tmp_path):
    convert_to_fp8_block(ckpts["glm_moe_dsa"], tmp_path / "fp8")
    name = "model.layers.1.mlp.experts.0.up_proj.weight"

    def poison(tensors):
        codes = tensors[name].view(torch.uint8).clone()
        codes[0, 0] = 0xFF                                   # e4m3fn's (negative) NaN
        tensors[name] = codes.view(torch.float8_e4m3fn)
    with pytest.raises(NanoError, match=f"tensor {name} contains NaN"):
        load(rewrite(tmp_path / "fp8", tmp_path / "nan", poison))


def test_non_finite_weight(ckpts, tmp_path):
    name = "model.layers.1.mlp.shared_experts.down_proj.weight"

    def poison(tensors):
        tensors[name] = tensors[name].clone()
        tensors[name][3, 5] = float("nan")
    expect_error(rewrite(ckpts["deepseek_v3"], tmp_path / "bad", poison), rf"^tensor {name} contains NaN or inf")


def test_overflow_when_casting_is_non_finite(ckpts, tmp_path):
    name = "model.norm.weight"
    ckpt = rewrite(ckpts["glm4_moe_lite"], tmp_path / "bad", lambda t: t.update({name: torch.full((64,), 1e5)}))
    with pytest.raises(NanoError, match=f"tensor {name} contains NaN or inf"):
        load(ckpt, dtype=torch.float16)


def test_scale_on_unquantized_weight_names_tensor(ckpts, tmp_path):
    name = "model.layers.0.mlp.up_proj.weight"
    ckpt = rewrite(ckpts["glm4_moe_lite"], tmp_path / "bad",
                   lambda t: t.update({f"{name}_scale_inv": torch.ones(2, 1)}))
    expect_error(ckpt, f"^tensor {name}: FP8 block weight must be float8, got torch.float32$")


def test_wrong_fp8_scale_shape_names_tensor(ckpts, tmp_path):
    convert_to_fp8_block(ckpts["glm4_moe_lite"], tmp_path / "fp8")
    name = "model.layers.0.mlp.down_proj.weight"
    ckpt = rewrite(tmp_path / "fp8", tmp_path / "bad", lambda t: t.update({f"{name}_scale_inv": torch.ones(1, 1)}))
    expect_error(ckpt, rf"^tensor {name}: FP8 weight of shape \(64, 192\) with 128x128 blocks needs weight_scale_inv "
                       rf"of shape \(1, 2\), got \(1, 1\)$")


def test_truncated_safetensors_file(ckpts, tmp_path):
    ckpt = tmp_path / "bad"
    shutil.copytree(ckpts["deepseek_v3"], ckpt)
    file = ckpt / "model.safetensors"
    file.write_bytes(file.read_bytes()[:-1000])
    expect_error(ckpt, rf"cannot read {file}: .*truncated or corrupt")


def test_garbage_safetensors_header(ckpts, tmp_path):
    ckpt = tmp_path / "bad"
    shutil.copytree(ckpts["deepseek_v3"], ckpt)
    (ckpt / "model.safetensors").write_bytes(b"\xff" * 64)
    expect_error(ckpt, "model.safetensors: .*truncated or corrupt")


def test_index_listing_a_missing_shard(ckpts, tmp_path):
    sharded = shard(ckpts["deepseek_v3"], tmp_path / "sharded", 3)
    (sharded / "model-00002-of-00003.safetensors").unlink()
    expect_error(sharded, "model.safetensors.index.json lists shard model-00002-of-00003.safetensors which is "
                          "missing from")


@pytest.mark.parametrize("text", ["{not json", "[" * 100_000])
def test_invalid_index(ckpts, tmp_path, text):
    sharded = shard(ckpts["deepseek_v3"], tmp_path / "sharded", 2)
    (sharded / "model.safetensors.index.json").write_text(text)
    expect_error(sharded, "is not a valid safetensors index")


def test_a_tensor_in_two_shards_is_refused_naming_both(ckpts, tmp_path):
    sharded = shard(ckpts["deepseek_v3"], tmp_path / "sharded", 2)
    first, second = sorted(sharded.glob("*.safetensors"))
    name, value = next(iter(load_file(first).items()))
    save_file({**load_file(second), name: value}, second)
    expect_error(sharded, rf"^tensor {re.escape(name)} is in two shards, {re.escape(str(first))} and "
                          rf"{re.escape(str(second))}$")


def test_no_weight_files(ckpts, tmp_path):
    ckpt = tmp_path / "empty"
    ckpt.mkdir()
    shutil.copy(ckpts["deepseek_v3"] / "config.json", ckpt)
    expect_error(ckpt, r"no \*\.safetensors weights in")


@pytest.mark.parametrize("quantization_config, pattern", [
    ({"quant_method": "gptq"}, "unsupported quantization method 'gptq'"),
    ({"quant_method": "compressed-tensors", "format": "pack-quantized", "config_groups": {"g": {"weights": {
        "num_bits": 8, "type": "int", "strategy": "group", "group_size": 32, "symmetric": True}}}},
     "unsupported compressed-tensors scheme in g"),
    ({"quant_method": "compressed-tensors", "format": "pack-quantized", "config_groups": {"g": {"weights": {
        "num_bits": 4, "type": "int", "strategy": "group", "group_size": 32, "symmetric": False}}}},
     "symmetric group-wise INT4 only"),
    ({"quant_method": "compressed-tensors", "format": "pack-quantized", "config_groups": {}}, "one INT4 group_size"),
])
def test_unsupported_quantization(ckpts, tmp_path, quantization_config, pattern):
    ckpt = tmp_path / "bad"
    shutil.copytree(ckpts["deepseek_v3"], ckpt)
    config = read_raw_config(ckpt)
    config["quantization_config"] = quantization_config
    (ckpt / "config.json").write_text(json.dumps(config))
    expect_error(ckpt, pattern)


def test_unsupported_model_type_lists_supported(ckpts, tmp_path):
    config = read_raw_config(ckpts["deepseek_v3"])
    config["model_type"] = "llama"
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(NanoError, match="unsupported model_type 'llama'; nano supports: deepseek_v3, glm4_moe_lite, "
                                        "glm_moe_dsa, kimi_k2, kimi_k25"):
        ModelConfig.from_hf(read_config(tmp_path))


def test_deeply_nested_config_is_one_line(tmp_path):
    (tmp_path / "config.json").write_text("[" * 100_000)
    with pytest.raises(NanoError, match=r"^cannot read .*config.json: maximum recursion depth exceeded"):
        read_config(tmp_path)


def test_read_config_errors(tmp_path):
    with pytest.raises(NanoError, match="no config.json in"):
        read_config(tmp_path)
    (tmp_path / "config.json").write_text("{oops")
    with pytest.raises(NanoError, match="cannot read .*config.json"):
        read_config(tmp_path)
    (tmp_path / "config.json").write_text("[1, 2]")
    with pytest.raises(NanoError, match="must hold a JSON object"):
        read_config(tmp_path)


# ---- resolving model names ------------------------------------------------------------------------------------

@pytest.fixture
def hub_cache(tmp_path, monkeypatch) -> Path:
    """An empty, offline Hugging Face cache."""
    cache = tmp_path / "hub"
    cache.mkdir()
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(cache))
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    return cache


def cache_snapshot(cache: Path, hub_id: str, files: Path, with_weights: bool = True) -> Path:
    repo = cache / f"models--{hub_id.replace('/', '--')}"
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text("0123abcd")
    snapshot = repo / "snapshots" / "0123abcd"
    shutil.copytree(files, snapshot, ignore=None if with_weights else shutil.ignore_patterns("*.safetensors"))
    return snapshot


def test_preset_without_weights_is_its_trained_stand_in(hub_cache):
    resolved = resolve_model("glm-5.2")
    assert resolved.kind == "trained" and resolved.preset is PRESETS["glm-5.2"]
    assert (resolved.path / "model.safetensors").is_file() and (resolved.path / "tokenizer.json").is_file()
    shapes = safetensors_shapes(resolved.path / "model.safetensors")
    parameters = sum(math.prod(shape) for key, shape in shapes.items() if not key.endswith("e_score_correction_bias"))
    assert resolved.label == (f"trained nano stand-in of glm-5.2, {parameters:,} parameters, trained on Shakespeare "
                              f"(Project Gutenberg; Hamlet and The Tempest held out)")


def test_random_suffix_names_the_random_weight_stand_in(hub_cache):
    resolved = resolve_model("glm-5.2-random")
    assert resolved == Resolved("nano", None, PRESETS["glm-5.2"],
                                "nano glm-5.2-random (random weights, same architecture as zai-org/GLM-5.2)")
    assert resolve_model("moonlight-16b").kind == "nano"            # a preset without a trained stand-in
    with pytest.raises(NanoError, match="unknown model 'gpt-17-random'"):
        resolve_model("gpt-17-random")


def safetensors_shapes(file: Path) -> dict[str, tuple[int, ...]]:
    with safe_open(str(file), framework="pt") as f:   # the router's correction bias is a buffer, not a parameter
        return {key: tuple(f.get_slice(key).get_shape()) for key in f.keys()}


def test_preset_found_in_hf_cache(hub_cache, ckpts):
    snapshot = cache_snapshot(hub_cache, "zai-org/GLM-4.7-Flash", ckpts["glm4_moe_lite"])
    resolved = resolve_model("glm-4.7-flash")
    assert (resolved.kind, resolved.path, resolved.preset) == ("checkpoint", snapshot, PRESETS["glm-4.7-flash"])
    assert resolved.label == f"checkpoint {snapshot} (glm4_moe_lite)"


def test_preset_with_config_only_in_cache_is_nano(hub_cache, ckpts):
    cache_snapshot(hub_cache, "zai-org/GLM-4.7-Flash", ckpts["glm4_moe_lite"], with_weights=False)
    assert resolve_model("glm-4.7-flash").kind == "nano"


def test_preset_with_weights_dir(hub_cache, ckpts):
    resolved = resolve_model("kimi-k2.6-random", weights=str(ckpts["deepseek_v3"]))
    assert (resolved.kind, resolved.path, resolved.preset) == ("checkpoint", ckpts["deepseek_v3"],
                                                               PRESETS["kimi-k2.6"])


def test_local_directory(ckpts):
    resolved = resolve_model(str(ckpts["glm_moe_dsa"]))
    assert resolved == Resolved("checkpoint", ckpts["glm_moe_dsa"], None,
                                f"checkpoint {ckpts['glm_moe_dsa']} (glm_moe_dsa)")


def test_bad_directories(tmp_path):
    with pytest.raises(NanoError, match=f"^no such model directory: {tmp_path}/nope$"):
        resolve_model(str(tmp_path / "nope"))
    with pytest.raises(NanoError, match="no such model directory: ./models/x"):
        resolve_model("./models/x")
    with pytest.raises(NanoError, match="has no config.json"):
        resolve_model(str(tmp_path))
    with pytest.raises(NanoError, match="no such model directory"):
        resolve_model("glm-5.2-random", weights=str(tmp_path / "nope"))
    (tmp_path / "file").write_text("x")
    with pytest.raises(NanoError, match="is not a directory"):
        resolve_model(str(tmp_path / "file"))


def test_hub_id_offline_fails_fast_with_one_line(hub_cache):
    with pytest.raises(NanoError, match=r"^cannot download nano-test/absent: .* \(no network\? pass a local "
                                        r"directory\)$") as info:
        resolve_model("nano-test/absent")
    assert "\n" not in str(info.value)


def test_hub_id_downloads_snapshot(hub_cache, ckpts, monkeypatch):
    calls = []

    def fake_download(repo_id, **kwargs):
        calls.append((repo_id, kwargs["allow_patterns"]))
        return str(ckpts["deepseek_v3"])
    monkeypatch.setattr(huggingface_hub, "snapshot_download", fake_download)
    resolved = resolve_model("moonshotai/Moonlight-16B-A3B-Instruct")
    assert resolved.kind == "checkpoint" and resolved.path == ckpts["deepseek_v3"]
    assert calls[0][0] == "moonshotai/Moonlight-16B-A3B-Instruct" and "*.safetensors" in calls[0][1]


def test_unknown_name_lists_presets():
    with pytest.raises(NanoError, match="unknown model 'gpt-17': not a preset \\(kimi-k2.6, glm-5.2, "):
        resolve_model("gpt-17")


# ---- hostile or absurd checkpoints (each refused before anything large is allocated) ---------------------------

@pytest.mark.parametrize("field, value", [
    ("vocab_size", -512), ("intermediate_size", -192), ("kv_lora_rank", -32), ("moe_intermediate_size", -1),
    ("n_routed_experts", 1_000_000), ("index_topk", -8), ("index_topk", 0), ("max_position_embeddings", -256),
    ("num_hidden_layers", -3), ("v_head_dim", 0), ("index_n_heads", 0), ("rms_norm_eps", 0.0),
])
def test_out_of_range_config_values_name_the_field(ckpts, tmp_path, field, value):
    ckpt = tmp_path / "bad"
    shutil.copytree(ckpts["glm_moe_dsa"], ckpt)
    raw = read_raw_config(ckpt)
    raw[field] = value
    (ckpt / "config.json").write_text(json.dumps(raw))
    with pytest.raises(NanoError, match=rf"^config\.json: {field} must be .*got {value}$"):
        ModelConfig.from_hf(read_config(ckpt))


YARN = {"rope_type": "yarn", "rope_theta": 10000.0, "original_max_position_embeddings": 64}


@pytest.mark.parametrize("edit, pattern", [
    ({"vocab_size": "512"}, "vocab_size must be an integer, got '512'"),
    ({"vocab_size": 512.7}, "vocab_size must be an integer, got 512.7"),
    ({"num_hidden_layers": True}, "num_hidden_layers must be an integer from 1 to 1,024, got True"),
    ({"n_shared_experts": False}, "n_shared_experts must be an integer, got False"),
    ({"bos_token_id": "x"}, "bos_token_id must be an integer, got 'x'"),
    ({"eos_token_id": -1}, "eos_token_id -1 is not a token id of the 512-token vocabulary"),
    ({"eos_token_id": 10**9}, "eos_token_id 1000000000 is not a token id of the 512-token vocabulary"),
    ({"eos_token_id": [1, 512]}, "eos_token_id 512 is not a token id"),
    ({"rope_parameters": {**YARN, "factor": -1}}, "YaRN's factor must be a finite number >= 1, got -1"),
    ({"rope_parameters": {**YARN, "factor": 0}}, "YaRN's factor must be a finite number >= 1, got 0"),
    ({"rope_parameters": {**YARN, "factor": 4.0, "beta_fast": "32"}}, "YaRN's beta_fast must be a finite number"),
    ({"rope_parameters": {**YARN, "factor": 4.0, "original_max_position_embeddings": 0}},
     "original_max_position_embeddings must be an integer from 1"),
    ({"norm_topk_prob": "false"}, "norm_topk_prob must be true or false, got 'false'"),
    ({"quantization_config": "fp8"}, "quantization_config must be an object, got 'fp8'"),
])
def test_questionable_config_values_are_refused(ckpts, edit, pattern):
    """Values a lenient parser would coerce ("512" -> 512, 512.7 -> 512, True -> 1) or take as they are (an end
    token outside the vocabulary, a YaRN factor below 1, which transformers warns about) are refused by name."""
    raw = {**read_raw_config(ckpts["deepseek_v3"]), **edit}
    with pytest.raises(NanoError, match=f"^config\\.json: {re.escape(pattern)}") as err:
        ModelConfig.from_hf(raw)
    assert "\n" not in str(err.value)


@pytest.mark.parametrize("edit, pattern", [
    ({"num_hidden_layers": 1024, "n_routed_experts": 16384}, "num_hidden_layers is 1,024 but the checkpoint's "
                                                             "tensors hold 3 layers"),
    ({"n_routed_experts": 16384}, "n_routed_experts is 16,384 but the checkpoint's tensors hold 4 experts per layer"),
    ({"vocab_size": 4096}, "vocab_size 4,096 and hidden_size 64 do not match the checkpoint's embedding of shape "
                           "(512, 64)"),
])
def test_config_sizes_are_checked_against_the_checkpoint_before_a_model_is_built(ckpts, tmp_path, edit, pattern):
    """Sizes within nano's limits but not the checkpoint's (the report's 1,024 layers of 16,384 experts hung for
    minutes while the model was built) are refused from the shards' headers by `resolve_model`, which everything
    that loads a model goes through first (`resolve_config`: LLM, the split's front, the CLI)."""
    ckpt = tmp_path / "bad"
    shutil.copytree(ckpts["deepseek_v3"], ckpt)
    (ckpt / "config.json").write_text(json.dumps({**read_raw_config(ckpt), **edit}))
    ModelConfig.from_hf(read_config(ckpt))                    # the config alone is acceptable
    for resolve in (resolve_model, resolve_config):
        with pytest.raises(NanoError, match=f"^config\\.json: {re.escape(pattern)}$"):
            resolve(str(ckpt))


@pytest.mark.parametrize("dtype", [torch.int32, torch.bool])
def test_integer_and_boolean_weights_are_refused_by_name(ckpts, tmp_path, dtype):
    name = "model.layers.0.self_attn.kv_b_proj.weight"
    ckpt = rewrite(ckpts["deepseek_v3"], tmp_path / "bad", lambda t: t.update({name: (t[name] * 100).to(dtype)}))
    expect_error(ckpt, rf"^tensor {name} has dtype {dtype}; weights must be floating point")


@pytest.mark.parametrize("where", ["../outside/stolen.safetensors", "ABSOLUTE", "sub/stolen.safetensors"])
def test_index_shards_must_stay_inside_the_checkpoint(ckpts, tmp_path, where):
    """Also through a folder inside the checkpoint that is a symlink to one outside it (`sub`)."""
    sharded = shard(ckpts["deepseek_v3"], tmp_path / "ckpt" / "sharded", 2)
    outside = tmp_path / "ckpt" / "outside"
    outside.mkdir()
    (sharded / "sub").symlink_to(outside, target_is_directory=True)
    index = json.loads((sharded / "model.safetensors.index.json").read_text())
    first = sorted(set(index["weight_map"].values()))[0]
    shutil.move(sharded / first, outside / "stolen.safetensors")
    target = str(outside / "stolen.safetensors") if where == "ABSOLUTE" else where
    index["weight_map"] = {k: target if v == first else v for k, v in index["weight_map"].items()}
    (sharded / "model.safetensors.index.json").write_text(json.dumps(index))
    expect_error(sharded, "names shard .*stolen.safetensors.* outside the checkpoint directory")


def test_shard_files_may_be_symlinks_to_anywhere(ckpts, tmp_path):
    """As in the Hugging Face cache: each file of a snapshot folder is a symlink to a blob outside it."""
    blobs = shard(ckpts["deepseek_v3"], tmp_path / "blobs", 2)
    snapshot = tmp_path / "snapshot"
    snapshot.mkdir()
    for blob in blobs.iterdir():
        (snapshot / blob.name).symlink_to(blob)
    assert resolve_model(str(snapshot)).path == snapshot
    assert_loaded(load(snapshot), reference_state_dict(ckpts["deepseek_v3"]))


def test_a_fifo_shard_is_refused_instead_of_blocking(ckpts, tmp_path):
    ckpt = tmp_path / "bad"
    shutil.copytree(ckpts["deepseek_v3"], ckpt)
    (ckpt / "model.safetensors").unlink()
    os.mkfifo(ckpt / "model.safetensors")
    expect_error(ckpt, "model.safetensors is not a regular file")
