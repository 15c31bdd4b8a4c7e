"""Find a model and load its weights.

`resolve_model` turns what the user typed (a preset name, a local directory or a Hub repo id) into a checkpoint
directory, or into a *nano* stand-in when a preset's real weights are not available. `load_weights` streams a
checkpoint's safetensors shards into a model whose `state_dict()` uses the Hugging Face tensor names, one tensor
at a time. Quantized weights stay in their format: FP8-block Linears become Fp8Linear, compressed-tensors INT4
ones Int4Linear; only what nano reads as a plain matrix (kv_b_proj) is dequantized on the way.
"""
from __future__ import annotations

import contextlib
import json
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn
from safetensors import SafetensorError, safe_open

from nano.config import ModelConfig, read_json
from nano.errors import NanoError, brief
from nano.presets import RANDOM_SUFFIX, Preset, check_model_name, find_preset
from nano.quant import FP8_DTYPES, Fp8Linear, Int4Linear, dequantize_fp8_block, keeps_high_precision

INDEX_FILE = "model.safetensors.index.json"
DOWNLOAD_PATTERNS = ["*.json", "*.safetensors", "*.jinja", "tokenizer*", "*.tiktoken", "tiktoken.model"]
_LAYER = re.compile(r"model\.layers\.(\d+)\.")
_EXPERT = re.compile(r"model\.layers\.\d+\.mlp\.experts\.(\d+)\.")
STANDINS = Path(__file__).parent / "standins"     # the trained stand-ins (tools/train_standin.py)


# ---- one rank's part of a checkpoint --------------------------------------------------------------------------

@dataclass(frozen=True)
class TensorSlice:
    """Indices [start, stop) of dimension `dim` of a checkpoint tensor."""
    dim: int
    start: int
    stop: int


@dataclass(frozen=True)
class Sharding:
    """What one rank of a tensor-parallel model holds (nano/parallel.py `shard` makes it): slices of the split
    tensors, by model tensor name, and the routed experts it keeps; the loader reads only those."""
    rank: int
    world: int
    slices: dict[str, TensorSlice]
    dropped_prefixes: tuple[str, ...]    # module names of the routed experts other ranks hold

    def drops(self, name: str) -> bool:
        return name.startswith(self.dropped_prefixes)


# ---- resolving a model name -----------------------------------------------------------------------------------

@dataclass
class Resolved:
    kind: str               # "checkpoint": real weights at `path`; "trained": the trained stand-in of `preset`
                            # shipped at `path` (an ordinary checkpoint); "nano": a random-weight stand-in
    path: Path | None       # None only for "nano"
    preset: Preset | None
    label: str              # what the CLI prints


def resolve_model(name: str, weights: str | None = None) -> Resolved:
    """Resolve a preset name, local directory or Hub id (optionally with an explicit weights DIR).

    A preset resolves to its real checkpoint when one is available, else to its trained stand-in when nano ships
    one (nano/standins/), else to a random-weight stand-in. `<preset>-random` always names the random-weight
    stand-in: larger, for speed experiments."""
    preset, random_weights = find_preset(name)
    if weights is not None:
        return _checkpoint(_model_dir(Path(weights).expanduser()), preset)
    if preset is not None:
        cached = None if random_weights else _cached_snapshot(preset.hub_id)
        if cached is not None:
            return _checkpoint(cached, preset)
        trained = None if random_weights else trained_record(preset.name)
        if trained is not None:
            return Resolved("trained", STANDINS / preset.name, preset, trained["label"])
        return Resolved("nano", None, preset, f"nano {name} (random weights, same architecture as {preset.hub_id})")
    check_model_name(name)   # then it is an existing path, or else a Hub id
    path = Path(name).expanduser()
    return _checkpoint(_model_dir(path if path.exists() else _download(name)), None)


def trained_record(preset: str) -> dict[str, Any] | None:
    """The training.json of the trained stand-in nano ships for `preset` (what it was trained on, its size, its
    held-out figures), or None when there is none."""
    file = STANDINS / preset / "training.json"
    if not file.is_file():
        return None
    try:
        record = json.loads(file.read_text())
        record["label"] = (f"trained nano stand-in of {record['preset']}, {record['parameters']:,} parameters, "
                           f"trained on {record['trained_on']}")
        return record
    except (OSError, ValueError, KeyError, TypeError):
        raise NanoError(f"{file} is unreadable (reinstall nano, or pass {preset}{RANDOM_SUFFIX} for the "
                        f"random-weight stand-in)") from None


def _checkpoint(path: Path, preset: Preset | None) -> Resolved:
    """A checkpoint directory whose config.json fits its weights (`check_sizes`)."""
    cfg = ModelConfig.from_hf(read_config(path))
    check_sizes(path, cfg)
    return Resolved("checkpoint", path, preset, f"checkpoint {path} ({cfg.model_type})")


def _model_dir(path: Path) -> Path:
    if not path.exists():
        raise NanoError(f"no such model directory: {path}")
    if not path.is_dir():
        raise NanoError(f"{path} is not a directory (pass the folder that holds config.json)")
    if not (path / "config.json").is_file():
        raise NanoError(f"{path} has no config.json (not a Hugging Face model directory)")
    return path


def _cached_snapshot(hub_id: str) -> Path | None:
    """The local Hugging Face cache's snapshot of `hub_id` if it holds a config and all weight shards (no network)."""
    from huggingface_hub import try_to_load_from_cache

    config = try_to_load_from_cache(hub_id, "config.json")
    if not isinstance(config, str):
        return None
    snapshot = Path(config).parent
    try:
        _shard_files(snapshot)
    except NanoError:
        return None
    return snapshot


def _download(repo_id: str) -> Path:
    from huggingface_hub import snapshot_download

    try:  # honours HF_HUB_OFFLINE=1; without a network the name lookup fails within milliseconds
        return Path(snapshot_download(repo_id, allow_patterns=DOWNLOAD_PATTERNS, etag_timeout=10))
    except Exception as err:  # network, authentication, unknown repo: all reach the user as one line
        reason = brief(err)
        raise NanoError(f"cannot download {repo_id}: {reason} (no network? pass a local directory)") from None


def read_config(path: Path) -> dict[str, Any]:
    """The parsed config.json of a model directory (or the path of the file itself)."""
    file = path / "config.json" if path.is_dir() else path
    return read_json(file, missing=f"no config.json in {file.parent}")


# ---- reading checkpoint files ---------------------------------------------------------------------------------

def _shard_files(path: Path) -> list[Path]:
    """The safetensors files of a checkpoint: those the index lists (all must exist), else every *.safetensors.
    Each must be a regular file (a FIFO would block the reader) in a folder inside the checkpoint directory (an
    index may not point elsewhere, through `..`, an absolute path or a symlinked folder). A shard file may be a
    symlink to anywhere: the Hugging Face cache links each snapshot file to its blob."""
    index = path / INDEX_FILE
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
            names = sorted(set(weight_map.values()))
        except (OSError, UnicodeDecodeError, json.JSONDecodeError, RecursionError, KeyError, TypeError,
                AttributeError):
            raise NanoError(f"{index} is not a valid safetensors index (no weight_map)") from None
        root = os.path.realpath(path)
        outside = [n for n in names if not isinstance(n, str)
                   or os.path.commonpath([root, os.path.realpath((path / n).parent)]) != root]
        if outside:
            raise NanoError(f"{INDEX_FILE} names shard {outside[0]!r} outside the checkpoint directory {path}")
        missing = [n for n in names if not (path / n).exists()]
        if missing:
            raise NanoError(f"{INDEX_FILE} lists shard {missing[0]} which is missing from {path}"
                            + (f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""))
        files = [path / n for n in names]
    else:
        files = sorted(path.glob("*.safetensors"))
        if not files:
            raise NanoError(f"no *.safetensors weights in {path}")
    irregular = [file for file in files if not file.is_file()]
    if irregular:
        raise NanoError(f"{irregular[0]} is not a regular file (a weight shard must be one)")
    return files


class _Checkpoint:
    """The open shards of one checkpoint and which file holds each tensor name."""

    def __init__(self, files: list[Path], stack: contextlib.ExitStack):
        self.file_of: dict[str, Path] = {}
        self._handles = {}
        for file in files:
            try:
                handle = stack.enter_context(safe_open(str(file), framework="pt"))
            except (SafetensorError, OSError) as err:
                raise NanoError(f"cannot read {file}: {err} (truncated or corrupt safetensors file?)") from None
            self._handles[file] = handle
            for key in handle.keys():
                if key in self.file_of:
                    raise NanoError(f"tensor {key} is in two shards, {self.file_of[key]} and {file}")
                self.file_of[key] = file

    def shape(self, source: _Source) -> tuple[int, ...]:
        """A model tensor's shape in the checkpoint (packed INT4: the logical [N, K] its weight_shape holds)."""
        if source.kind == "int4":
            return tuple(int(d) for d in self.tensor(source.keys["shape"]))
        key = source.keys["weight"]
        return tuple(self._handles[self.file_of[key]].get_slice(key).get_shape())

    def tensor(self, key: str, piece: TensorSlice | None = None) -> torch.Tensor:
        """The tensor, or only `piece` of it (one rank's slice: the rest is never read)."""
        try:
            handle = self._handles[self.file_of[key]]
            if piece is None:
                return handle.get_tensor(key)
            index = (slice(None),) * piece.dim + (slice(piece.start, piece.stop),)     # whole dims, then the piece
            return handle.get_slice(key)[index]
        except (SafetensorError, OSError) as err:
            raise NanoError(f"cannot read tensor {key} from {self.file_of[key]}: {err}") from None


@dataclass
class _Source:
    """One model tensor and the checkpoint tensors it is decoded from."""
    name: str                # model state_dict name
    kind: str                # "plain" | "fp8" | "int4"
    keys: dict[str, str]     # role ("weight", "scale_inv", "packed", "scale", "shape") -> checkpoint name


@dataclass
class _QuantFormat:
    fp8_block: tuple[int, int]
    int4_group_size: int | None


def _quant_format(qc: dict[str, Any] | None) -> _QuantFormat:
    method = (qc or {}).get("quant_method")
    if method not in (None, "fp8", "compressed-tensors"):
        raise NanoError(f"unsupported quantization method {method!r} (nano reads fp8 block and "
                        f"compressed-tensors pack-quantized INT4 checkpoints)")
    block = (128, 128)
    if method == "fp8" and qc.get("weight_block_size"):
        block = tuple(int(b) for b in qc["weight_block_size"])
        if len(block) != 2:
            raise NanoError(f"fp8 weight_block_size must have two entries, got {qc['weight_block_size']}")
    group_size = None
    if method == "compressed-tensors":
        sizes = set()
        for group_name, group in (qc.get("config_groups") or {}).items():
            weights = group.get("weights") or {}
            fmt = group.get("format") or qc.get("format")
            if fmt != "pack-quantized" or weights.get("num_bits") != 4 or weights.get("type", "int") != "int":
                raise NanoError(f"unsupported compressed-tensors scheme in {group_name}: format {fmt!r}, "
                                f"{weights.get('num_bits')}-bit {weights.get('type')} (nano reads pack-quantized INT4)")
            if not weights.get("symmetric", True) or weights.get("strategy") != "group":
                raise NanoError(f"unsupported compressed-tensors scheme in {group_name}: nano reads symmetric "
                                f"group-wise INT4 only")
            sizes.add(int(weights["group_size"]))
        if len(sizes) != 1:
            raise NanoError(f"compressed-tensors config must give one INT4 group_size, found {sorted(sizes) or 'none'}")
        group_size = sizes.pop()
    return _QuantFormat(block, group_size)


def _skipped(name: str, cfg: ModelConfig) -> bool:
    """Tensors nano never loads: MTP layers past the last decoder layer and cached RoPE tables."""
    layer = _LAYER.match(name)
    return (layer is not None and int(layer.group(1)) >= cfg.num_hidden_layers) or name.endswith(".inv_freq")


_COMPANIONS = (".weight_scale_inv", ".weight_scale", ".weight_shape")


def _plan(ckpt: _Checkpoint, cfg: ModelConfig) -> tuple[list[_Source], list[str]]:
    """Group checkpoint tensors into model tensors; also return companion tensors nothing claims."""
    prefix = cfg.weight_prefix
    keys = {key[len(prefix):]: key for key in ckpt.file_of if key.startswith(prefix)}  # other towers drop out
    keys = {name: key for name, key in keys.items() if not _skipped(name, cfg)}
    sources, claimed = [], set()
    for name, key in keys.items():
        if name.endswith(".weight_packed"):
            stem = name.removesuffix("_packed")
            parts = {"packed": key}
            for role in ("scale", "shape"):
                if f"{stem}_{role}" not in keys:
                    raise NanoError(f"INT4 tensor {key} has no {prefix}{stem}_{role} in the checkpoint")
                parts[role] = keys[f"{stem}_{role}"]
                claimed.add(f"{stem}_{role}")
            sources.append(_Source(stem, "int4", parts))
        elif name.endswith(".weight") and f"{name}_scale_inv" in keys:
            sources.append(_Source(name, "fp8", {"weight": key, "scale_inv": keys[f"{name}_scale_inv"]}))
            claimed.add(f"{name}_scale_inv")
        elif not name.endswith(_COMPANIONS):
            sources.append(_Source(name, "plain", {"weight": key}))
    orphans = [name for name in keys if name.endswith(_COMPANIONS) and name not in claimed]
    sources.sort(key=lambda s: (ckpt.file_of[next(iter(s.keys.values()))], s.name))  # read each file in turn
    return sources, orphans


def _pieces(source: _Source, fmt: _QuantFormat, sharding: Sharding | None) -> dict[str, TensorSlice | None]:
    """Which part of each of the source's checkpoint tensors this rank reads (None: all of it). An FP8 weight's
    slice takes whole scale blocks with it, so it must start (and end, unless at the end) on a block boundary."""
    piece = None if sharding is None else sharding.slices.get(source.name)
    if piece is None:
        return dict.fromkeys(source.keys)
    if source.kind == "int4":
        raise NanoError(f"tensor {source.name}: packed INT4 weights are not split across ranks (only whole experts)")
    pieces: dict[str, TensorSlice | None] = {"weight": piece}
    if source.kind == "fp8":
        block = fmt.fp8_block[piece.dim]
        if piece.start % block:
            raise NanoError(f"tensor {source.name}: this rank's slice [{piece.start}, {piece.stop}) of dim "
                            f"{piece.dim} does not start on an FP8 block of {block} (choose another --tp)")
        pieces["scale_inv"] = TensorSlice(piece.dim, piece.start // block, -(-piece.stop // block))
    return pieces


def _decode(source: _Source, parts: dict[str, torch.Tensor], fmt: _QuantFormat) -> torch.Tensor:
    """One dense model tensor from its checkpoint tensors, dequantized when it is FP8 blocks."""
    if source.kind == "plain":
        if parts["weight"].dtype in FP8_DTYPES:
            raise NanoError(f"tensor {source.keys['weight']} is FP8 but the checkpoint has no weight_scale_inv for it")
        if not parts["weight"].is_floating_point():
            raise NanoError(f"tensor {source.keys['weight']} has dtype {parts['weight'].dtype}; weights must be "
                            f"floating point (or FP8 / INT4 with their scales)")
        return parts["weight"]
    try:   # (packed INT4 never comes here: it stays packed, _keep_quantized)
        return dequantize_fp8_block(_finite_fp8(parts["weight"], source), parts["scale_inv"], fmt.fp8_block)
    except NanoError as err:
        raise NanoError(f"tensor {source.name}: {err}") from None


def _finite_fp8(weight: torch.Tensor, source: _Source) -> torch.Tensor:
    """An e4m3fn weight, refused when it holds the NaN code (e4m3fn has no infinities)."""
    if weight.dtype == torch.float8_e4m3fn and bool(((weight.view(torch.uint8) & 0x7F) == 0x7F).any()):
        raise NanoError(f"tensor {source.keys['weight']} contains NaN values")
    return weight


def _stays_quantized(model: torch.nn.Module, source: _Source, fmt: _QuantFormat) -> bool:
    """Whether the checkpoint's quantized tensor becomes a quantized Linear (Int4Linear / Fp8Linear) instead of
    being dequantized into the model's dense weight: INT4 always; FP8 unless nano reads the weight as a matrix."""
    if source.kind == "int4":
        if fmt.int4_group_size is None:
            raise NanoError(f"tensor {source.keys['packed']} is packed INT4 but config.json has no "
                            f"compressed-tensors quantization_config")
        return True
    module_name = source.name.removesuffix(".weight")
    return (source.kind == "fp8" and source.name.endswith(".weight") and not keeps_high_precision(module_name)
            and isinstance(model.get_submodule(module_name), torch.nn.Linear))


def _keep_quantized(model: torch.nn.Module, source: _Source, parts: dict[str, torch.Tensor], fmt: _QuantFormat,
                    target: torch.Tensor) -> None:
    """Native INT4 stays INT4 and FP8 stays FP8: the Linear becomes an Int4Linear holding the checkpoint's packed
    words, or an Fp8Linear holding its e4m3 codes and block scales (its bias, if any, is kept as it is)."""
    parent, _, attr = source.name.removesuffix(".weight").rpartition(".")
    dense = getattr(model.get_submodule(parent), attr)
    try:
        if source.kind == "int4":
            quantized = Int4Linear(parts["packed"], parts["scale"], parts["shape"].tolist(), fmt.int4_group_size,
                                   target.dtype, dense.bias)
        else:
            quantized = Fp8Linear(_finite_fp8(parts["weight"], source), parts["scale_inv"], fmt.fp8_block, dense.bias)
    except NanoError as err:
        raise NanoError(f"tensor {source.name}: {err}") from None
    setattr(model.get_submodule(parent), attr, quantized)


def _load_tensor(model: torch.nn.Module, ckpt: _Checkpoint, source: _Source, pieces: dict[str, TensorSlice | None],
                 fmt: _QuantFormat, target: torch.Tensor) -> None:
    """Read one model tensor (this rank's piece of it) onto the model's device and put it in place: as a quantized
    Linear, or decoded into `target`'s dtype (allocated now when `target` is a meta tensor)."""
    parts = {role: ckpt.tensor(key, pieces[role]).to(model.device) for role, key in source.keys.items()}
    if _stays_quantized(model, source, fmt):
        _keep_quantized(model, source, parts, fmt, target)
        return
    value = _decode(source, parts, fmt).to(target.dtype)
    if value.is_floating_point() and not torch.isfinite(value).all():
        raise NanoError(f"tensor {source.name} contains NaN or inf values")
    if target.is_meta:   # allocated now, as read (a meta tensor cannot take data in place)
        module_name, _, attr = source.name.rpartition(".")
        setattr(model.get_submodule(module_name), attr, torch.nn.Parameter(value.clone(), False)
                if isinstance(target, torch.nn.Parameter) else value.clone())
    else:
        target.data.copy_(value)


def check_sizes(path: Path, cfg: ModelConfig) -> None:
    """Refuse, from the shards' headers alone, a config whose sizes are not the checkpoint's: fewer layers than
    `num_hidden_layers` (the highest layer index in the tensor names; MTP layers may follow), another routed expert
    count (the highest expert index) or an embedding of another shape. A config within nano's limits but not its
    weights would otherwise build a model of its own size before any tensor is compared (1,024 layers of 16,384
    experts: minutes, and gigabytes)."""
    with contextlib.ExitStack() as stack:
        ckpt = _Checkpoint(_shard_files(path), stack)
        names = [key[len(cfg.weight_prefix):] for key in ckpt.file_of if key.startswith(cfg.weight_prefix)]
        embedding = cfg.weight_prefix + "model.embed_tokens.weight"
        shape = ckpt.shape(_Source(embedding, "plain", {"weight": embedding})) if embedding in ckpt.file_of else None

    def count(pattern: re.Pattern[str]) -> int:   # 1 + the highest layer (expert) index the names hold
        return 1 + max((int(found.group(1)) for found in map(pattern.match, names) if found), default=-1)
    layers, experts = count(_LAYER), count(_EXPERT)
    if layers < cfg.num_hidden_layers:
        raise NanoError(f"config.json: num_hidden_layers is {cfg.num_hidden_layers:,} but the checkpoint's tensors "
                        f"hold {layers} layers")
    if "sparse" in cfg.mlp_layer_types and experts != cfg.n_routed_experts:
        raise NanoError(f"config.json: n_routed_experts is {cfg.n_routed_experts:,} but the checkpoint's tensors "
                        f"hold {experts} experts per layer")
    if shape is not None and shape != (cfg.vocab_size, cfg.hidden_size):
        raise NanoError(f"config.json: vocab_size {cfg.vocab_size:,} and hidden_size {cfg.hidden_size:,} do not "
                        f"match the checkpoint's embedding of shape {shape}")


def _first(names: list[str], limit: int = 3) -> str:
    return ", ".join(names[:limit]) + (", ..." if len(names) > limit else "")


def load_weights(model: torch.nn.Module, path: Path, cfg: ModelConfig, progress: bool = True,
                 sharding: Sharding | None = None) -> None:
    """Copy a checkpoint's tensors into `model` (HF names) on `model.device`, casting each to its tensor's dtype;
    FP8 and INT4 Linears stay quantized (see `_stays_quantized`). The model may be built with `materialize=False`:
    each weight is then allocated as it is read. With `sharding` (one rank of a tensor-parallel model) only this
    rank's slice of each split tensor is read, and other ranks' routed experts are skipped.

    Every model tensor must be loaded exactly once with the shape the config implies; MTP layers, other towers
    (Kimi K2.5 vision) and RoPE caches in the checkpoint are skipped. Raises NanoError on any mismatch.
    """
    fmt = _quant_format(cfg.quantization_config)
    targets = model.state_dict(keep_vars=True)  # name -> Parameter / buffer, tied names included
    with contextlib.ExitStack() as stack:
        ckpt = _Checkpoint(_shard_files(path), stack)
        sources, orphans = _plan(ckpt, cfg)
        if sharding is not None:
            sources = [s for s in sources if not sharding.drops(s.name)]
            orphans = [name for name in orphans if not sharding.drops(name)]

        unexpected = [s.name for s in sources if s.name not in targets] + orphans
        if unexpected:
            raise NanoError(f"checkpoint has {len(unexpected)} tensors the model does not expect, "
                            f"e.g. {_first(unexpected)}")
        loaded = {s.name for s in sources}
        optional = {"lm_head.weight"} if cfg.tie_word_embeddings else set()
        missing = [name for name in targets if name not in loaded and name not in optional]
        if missing:
            raise NanoError(f"checkpoint is missing {len(missing)} tensors, e.g. {_first(missing)}")
        pieces = {source.name: _pieces(source, fmt, sharding) for source in sources}
        for source in sources:
            have, want = list(ckpt.shape(source)), tuple(targets[source.name].shape)
            piece = pieces[source.name].get("weight")
            if piece is not None and piece.dim < len(have):
                have[piece.dim] = min(piece.stop, have[piece.dim]) - piece.start
            have = tuple(have)
            if have != want:
                raise NanoError(f"tensor {source.name} has shape {have} in the checkpoint "
                                f"but the config implies {want}")

        bar = Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeRemainingColumn(),
                       console=Console(stderr=True), transient=True, disable=not progress)
        shard_number = {file: i for i, file in enumerate(sorted(set(ckpt.file_of.values())), start=1)}
        with bar, torch.no_grad():
            task = bar.add_task("loading weights", total=len(sources))
            for source in sources:
                file = ckpt.file_of[next(iter(source.keys.values()))]
                bar.update(task, description=f"loading {file.name} ({shard_number[file]}/{len(shard_number)})")
                _load_tensor(model, ckpt, source, pieces[source.name], fmt, targets[source.name])
                bar.advance(task)
        model.tie_embeddings()
