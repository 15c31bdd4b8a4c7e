"""Tiny real-format checkpoints for tests, built with transformers and rewritten into the released formats.

`make_checkpoint` saves a seeded random `transformers` model (deepseek_v3 / glm_moe_dsa / glm4_moe_lite). The
converters rewrite a checkpoint directory the way the real releases are stored (FP8 128x128 blocks as in GLM-5-FP8,
compressed-tensors INT4 routed experts as in Kimi K2.6, sharded with an index, Kimi K2.5's nested layout) and
return the dequantized reference values the loader must reproduce.

The quantizers here are written independently of `nano.quant` (per-block / per-group loops, packing by
arithmetic instead of shifts) so that tests check the storage layout rather than mirror the decoder.

Also the shared helpers of the command-line tests: `nano(...)` runs a command in process, `assert_user_error`
checks the one-line `error:` convention.
"""
from __future__ import annotations

import json
import math
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

import torch
from click.testing import Result
from safetensors import safe_open
from safetensors.torch import save_file
from tokenizers import Tokenizer as RustTokenizer
from tokenizers import decoders, models, pre_tokenizers, trainers
from typer.testing import CliRunner

TEXT = "Grüße, 世界! naïve café 🙂🚀 ok"
GLM_SPECIALS = ["<|endoftext|>", "[gMASK]", "<sop>", "<|system|>", "<|user|>", "<|assistant|>", "<|observation|>"]
FP8_MAX = 448.0
INT4_MAX = 7  # symmetric QAT levels -7..7 (the -8 level is unused, as in the Kimi checkpoints)

# Small but real-shaped: the dense MLP width (192) is not a multiple of 128, so FP8 tensors get partial blocks,
# and every in-feature count (64 hidden, 32 expert width) is a multiple of the INT4 group size 32.
TINY = dict(
    vocab_size=512, hidden_size=64, intermediate_size=192, moe_intermediate_size=32, num_hidden_layers=3,
    num_attention_heads=4, num_key_value_heads=4, q_lora_rank=32, kv_lora_rank=32, qk_nope_head_dim=16,
    qk_rope_head_dim=8, v_head_dim=16, n_routed_experts=4, num_experts_per_tok=2, n_shared_experts=1,
    n_group=1, topk_group=1, first_k_dense_replace=1, max_position_embeddings=256, initializer_range=0.1,
    tie_word_embeddings=False,
)
TINY_INDEXER = dict(index_topk=8, index_head_dim=16, index_n_heads=2)

# Linear weights the releases quantize: attention (incl. the DSA indexer's projections) and every MLP / expert.
_FP8_TARGET = re.compile(r".*\.(self_attn\.(?!indexer\.weights_proj)[\w.]+|mlp\.([\w.]+\.)?(gate|up|down)_proj)"
                         r"\.weight$")
_ROUTED_EXPERT = re.compile(r".*\.mlp\.experts\.\d+\.(gate|up|down)_proj\.weight$")


def tiny_hf_model(model_type: str = "deepseek_v3", seed: int = 0, **overrides) -> torch.nn.Module:
    """A seeded random transformers model of `model_type` with the TINY dimensions (plus `overrides`)."""
    from transformers import (DeepseekV3Config, DeepseekV3ForCausalLM, Glm4MoeLiteConfig, Glm4MoeLiteForCausalLM,
                              GlmMoeDsaConfig, GlmMoeDsaForCausalLM)

    classes = {"deepseek_v3": (DeepseekV3Config, DeepseekV3ForCausalLM, {}),
               "glm_moe_dsa": (GlmMoeDsaConfig, GlmMoeDsaForCausalLM, TINY_INDEXER),
               "glm4_moe_lite": (Glm4MoeLiteConfig, Glm4MoeLiteForCausalLM, {})}
    config_class, model_class, extra = classes[model_type]
    torch.manual_seed(seed)
    model = model_class(config_class(**{**TINY, **extra, **overrides}))
    with torch.no_grad():
        for name, tensor in model.state_dict().items():
            if name.endswith("e_score_correction_bias"):  # HF zero-initialises it; give selection something to do
                tensor.copy_(torch.randn_like(tensor) * 0.1)
    return model.eval()


def make_checkpoint(dst: Path, model_type: str = "deepseek_v3", seed: int = 0,
                    dtype: torch.dtype = torch.float32, **overrides) -> Path:
    """Save a tiny random model of `model_type` as a Hugging Face checkpoint directory; returns `dst`."""
    model = tiny_hf_model(model_type, seed, **overrides).to(dtype)
    model.save_pretrained(dst)
    return Path(dst)


# ---- reading and writing checkpoint directories -----------------------------------------------------------------

def read_tensors(ckpt: Path) -> dict[str, torch.Tensor]:
    """Every tensor of every *.safetensors file in `ckpt`."""
    tensors = {}
    for file in sorted(Path(ckpt).glob("*.safetensors")):
        with safe_open(str(file), framework="pt") as f:
            tensors.update({key: f.get_tensor(key) for key in f.keys()})
    return tensors


def read_config(ckpt: Path) -> dict:
    return json.loads((Path(ckpt) / "config.json").read_text())


def write_checkpoint(dst: Path, tensors: dict[str, torch.Tensor], config: dict, src: Path | None = None) -> Path:
    """Write `tensors` as one model.safetensors plus config.json; other small files (tokenizer, generation
    config) are copied from `src`."""
    dst = Path(dst)
    _copy_side_files(src, dst, config)
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(dst / "model.safetensors"))
    return dst


def _copy_side_files(src: Path | None, dst: Path, config: dict) -> None:
    """Create `dst` with `config` as config.json and the non-weight files of `src` (tokenizer, generation config)."""
    dst.mkdir(parents=True, exist_ok=True)
    if src is not None:
        for file in Path(src).iterdir():
            if file.is_file() and file.suffix != ".safetensors" and file.name not in ("config.json",
                                                                                       "model.safetensors.index.json"):
                shutil.copy(file, dst / file.name)
    (dst / "config.json").write_text(json.dumps(config, indent=2))


def reference_state_dict(ckpt: Path) -> dict[str, torch.Tensor]:
    """The fp32 values of an unquantized checkpoint's tensors."""
    return {k: v.float() for k, v in read_tensors(ckpt).items()}


# ---- independent quantizers -------------------------------------------------------------------------------------

def quantize_fp8_block(w: torch.Tensor, block: tuple[int, int] = (128, 128)) -> tuple[torch.Tensor, torch.Tensor]:
    """w [N, K] -> (float8_e4m3fn [N, K], fp32 scale_inv [ceil(N/bn), ceil(K/bk)]) with w ~ fp8 * scale_inv."""
    rows, cols = w.shape
    bn, bk = block
    weight = torch.empty(rows, cols, dtype=torch.float8_e4m3fn)
    scale_inv = torch.empty(math.ceil(rows / bn), math.ceil(cols / bk), dtype=torch.float32)
    for bi in range(scale_inv.shape[0]):
        for bj in range(scale_inv.shape[1]):
            r, c = slice(bi * bn, (bi + 1) * bn), slice(bj * bk, (bj + 1) * bk)
            tile = w[r, c].float()
            scale = max(tile.abs().max().item(), 1e-12) / FP8_MAX
            weight[r, c] = (tile / scale).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
            scale_inv[bi, bj] = scale
    return weight, scale_inv


def dequantize_fp8_reference(weight: torch.Tensor, scale_inv: torch.Tensor,
                             block: tuple[int, int] = (128, 128)) -> torch.Tensor:
    """The value an FP8 block weight stands for, block by block."""
    out = weight.float()
    for bi in range(scale_inv.shape[0]):
        for bj in range(scale_inv.shape[1]):
            out[bi * block[0]:(bi + 1) * block[0], bj * block[1]:(bj + 1) * block[1]] *= scale_inv[bi, bj]
    return out


def pack_int4(w: torch.Tensor, group_size: int, scale_dtype: torch.dtype = torch.bfloat16
              ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """w [N, K] -> (weight_packed int32 [N, ceil(K/8)], weight_scale [N, ceil(K/G)], weight_shape int64 [2],
    dequantized reference fp32 [N, K]) in the compressed-tensors pack-quantized layout."""
    rows, cols = w.shape
    groups = math.ceil(cols / group_size)
    scale = torch.empty(rows, groups, dtype=scale_dtype)
    q = torch.empty(rows, cols, dtype=torch.int64)
    for g in range(groups):
        span = slice(g * group_size, (g + 1) * group_size)
        group = w[:, span].float()
        scale[:, g] = (group.abs().amax(dim=1) / INT4_MAX).clamp(min=1e-8).to(scale_dtype)
        q[:, span] = torch.round(group / scale[:, g:g + 1].float()).clamp(-8, 7).to(torch.int64)
    reference = q.float() * scale.float().repeat_interleave(group_size, dim=1)[:, :cols]
    words = math.ceil(cols / 8)
    unsigned = torch.zeros(rows, words * 8, dtype=torch.int64)   # the padding of the last word stays 0
    unsigned[:, :cols] = q + 8
    # word value = sum of nibble_j * 16**j: element k lands in word k // 8 at nibble k % 8
    packed = sum(unsigned[:, j::8] * 16 ** j for j in range(8))  # [N, words] in 0 .. 2**32 - 1
    packed = torch.where(packed >= 2 ** 31, packed - 2 ** 32, packed).to(torch.int32)
    return packed, scale, torch.tensor([rows, cols], dtype=torch.int64), reference


# ---- converters ---------------------------------------------------------------------------------------------

def convert_to_fp8_block(src: Path, dst: Path, block: tuple[int, int] = (128, 128)) -> dict[str, torch.Tensor]:
    """Rewrite attention / MLP / expert Linear weights as FP8 blocks (GLM-5-FP8 style); returns reference values."""
    tensors, reference = {}, {}
    for name, value in read_tensors(src).items():
        if _FP8_TARGET.match(name) and value.dim() == 2:
            weight, scale_inv = quantize_fp8_block(value, block)
            tensors[name], tensors[f"{name}_scale_inv"] = weight, scale_inv
            reference[name] = dequantize_fp8_reference(weight, scale_inv, block)
        else:
            tensors[name], reference[name] = value, value.float()
    config = read_config(src)
    config["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                                     "weight_block_size": list(block),
                                     "modules_to_not_convert": ["model.embed_tokens", "lm_head"]}
    write_checkpoint(dst, tensors, config, src)
    return reference


def convert_to_int4_ct(src: Path, dst: Path, group_size: int = 32) -> dict[str, torch.Tensor]:
    """Pack the routed experts as compressed-tensors INT4 (Kimi K2.6 style); returns reference values."""
    tensors, reference = {}, {}
    for name, value in read_tensors(src).items():
        if _ROUTED_EXPERT.match(name):
            stem = name.removesuffix(".weight")
            packed, scale, shape, reference[name] = pack_int4(value, group_size)
            tensors.update({f"{stem}.weight_packed": packed, f"{stem}.weight_scale": scale,
                            f"{stem}.weight_shape": shape})
        else:
            tensors[name], reference[name] = value, value.float()
    config = read_config(src)
    config["quantization_config"] = {
        "quant_method": "compressed-tensors", "format": "pack-quantized", "quantization_status": "compressed",
        "config_groups": {"group_0": {"targets": ["Linear"], "input_activations": None, "weights": {
            "num_bits": 4, "type": "int", "strategy": "group", "group_size": group_size, "symmetric": True,
            "dynamic": False, "actorder": None}}},
        "ignore": ["lm_head", "re:.*self_attn.*", "re:.*shared_experts.*", r"re:.*mlp\.(gate|up|down)_proj.*"],
    }
    write_checkpoint(dst, tensors, config, src)
    return reference


def shard(src: Path, dst: Path, n: int) -> Path:
    """Split a checkpoint into `n` shards with a model.safetensors.index.json. Tensors are dealt round-robin,
    so a quantized weight and its scale usually sit in different shards."""
    dst = Path(dst)
    tensors = read_tensors(src)
    _copy_side_files(src, dst, read_config(src))
    names = sorted(tensors)
    files = [f"model-{i + 1:05d}-of-{n:05d}.safetensors" for i in range(n)]
    weight_map = {name: files[i % n] for i, name in enumerate(names)}
    for file in files:
        save_file({k: tensors[k].contiguous() for k in names if weight_map[k] == file}, str(dst / file))
    total = sum(t.numel() * t.element_size() for t in tensors.values())
    (dst / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2))
    return dst


def make_kimi_k25(src: Path, dst: Path) -> Path:
    """Kimi K2.5 / K2.6 layout: config under `text_config` (model_type kimi_k2) in a kimi_k25 wrapper, language
    weights under `language_model.`, plus vision-tower / projector tensors and an MTP layer nano must skip."""
    inner = read_config(src)
    inner["model_type"] = "kimi_k2"
    outer = {"architectures": ["KimiK25ForConditionalGeneration"], "model_type": "kimi_k25", "text_config": inner,
             "vision_config": {"hidden_size": 16}, "tie_word_embeddings": inner.get("tie_word_embeddings", False)}
    tensors = {f"language_model.{k}": v for k, v in read_tensors(src).items()}
    generator = torch.Generator().manual_seed(1)
    mtp_layer = inner["num_hidden_layers"]
    tensors.update({
        "vision_tower.patch_embed.proj.weight": torch.randn(16, 3, 2, 2, generator=generator),
        "mm_projector.proj.0.weight": torch.randn(inner["hidden_size"], 16, generator=generator),
        f"language_model.model.layers.{mtp_layer}.eh_proj.weight":
            torch.randn(inner["hidden_size"], 2 * inner["hidden_size"], generator=generator),
    })
    return write_checkpoint(dst, tensors, outer, src)


def build_tokenizer_dir(path: Path, tokenizer_config: dict | None = None, generation_eos=None) -> Path:
    """A byte-level BPE trained on a few strings, with GLM's special tokens, saved like a HF checkpoint."""
    path.mkdir(parents=True, exist_ok=True)
    tok = RustTokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=GLM_SPECIALS, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator([TEXT, "hello world, hello there", "the quick brown fox", "Grüße café"] * 3, trainer)
    tok.save(str(path / "tokenizer.json"))
    if tokenizer_config is not None:
        (path / "tokenizer_config.json").write_text(json.dumps(tokenizer_config))
    if generation_eos is not None:
        (path / "generation_config.json").write_text(json.dumps({"eos_token_id": generation_eos}))
    return path


# ---- Triton kernels on CPU --------------------------------------------------------------------------------------
# @triton.jit reads TRITON_INTERPRET when it decorates a function (triton's own helpers are decorated when triton is
# first imported), so a kernel test module cannot switch the interpreter on for itself once anything imported
# triton. On a CPU-only run its tests are skipped in-process and `rerun_under_interpreter` runs the kernel test
# files again in a child process with TRITON_INTERPRET=1: all of them in one child, the first time one asks (a
# child's interpreter, torch and triton cost seconds), each file then reading its own results.
KERNELS_HERE = torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") == "1"
runs_kernels = pytest.mark.skipif(not KERNELS_HERE, reason="run by test_under_interpreter in a child process")
KERNEL_TEST_FILES = ("test_kernels.py", "test_weight_kernels.py")
_interpreted: dict[str, list[str]] = {}   # test file name -> its failed tests' reports (once the child has run)


def rerun_under_interpreter(test_file: str) -> None:
    """Fail with the child's report if any test of `test_file` failed under the interpreter, or none ran."""
    import tempfile
    import xml.etree.ElementTree as ElementTree

    pytest.importorskip("triton", reason="triton is not installed")
    name = Path(test_file).name
    if name not in _interpreted:   # under pytest-xdist the files may run in different workers: each its own
        files = [name] if "PYTEST_XDIST_WORKER" in os.environ else sorted({*KERNEL_TEST_FILES, name})
        tests = Path(__file__).parent
        handle, report = tempfile.mkstemp(suffix=".xml")
        os.close(handle)
        report = Path(report)
        try:
            child = subprocess.run([sys.executable, "-m", "pytest", "-q", "-n", "0", "-p", "no:cacheprovider",
                                    f"--junitxml={report}", *(str(tests / file) for file in files)],
                                   env={**os.environ, "TRITON_INTERPRET": "1"}, cwd=tests.parent,
                                   capture_output=True, text=True, timeout=900)
            cases = list(ElementTree.parse(report).getroot().iter("testcase")) if report.stat().st_size else []
        finally:
            report.unlink(missing_ok=True)
        results: dict[str, list[str]] = {file: [] for file in files}
        ran = dict.fromkeys(files, 0)
        for case in cases:
            file = case.get("classname", "").rpartition(".")[2] + ".py"
            if file not in results:
                continue
            problems = [f"{case.get('name')}: {p.get('message', '')}\n{p.text or ''}" for p in case
                        if p.tag in ("failure", "error")]
            results[file] += problems
            ran[file] += not problems and case.find("skipped") is None
        for file in files:
            if not ran[file] and not results[file]:
                results[file] = [f"no test of {file} ran: exit {child.returncode}\n{child.stdout[-6000:]}"
                                 f"{child.stderr[-2000:]}"]
        _interpreted.update(results)
    assert not _interpreted[name], "\n".join(_interpreted[name])[-8000:]


# ---- the command line, in process -------------------------------------------------------------------------------
# Typer's CliRunner runs `nano ...` inside the test process (stdout and stderr kept apart); the subprocess tests in
# test_cli.py run the installed entry points themselves.
def nano(*args: str, stdin: str | None = None) -> Result:
    """Run `nano ARGS...` in process, 200 columns wide, with `stdin` as its input."""
    from nano.cli.main import app   # imported here: tests that never run the CLI do not load it

    return CliRunner().invoke(app, list(args), input=stdin, env={"COLUMNS": "200"}, prog_name="nano")


def assert_user_error(result: Result, fragment: str, exit_code: int = 1) -> None:
    """Exit non-zero with one `error:` line (the last on stderr) that mentions `fragment`, and no traceback."""
    assert result.exit_code == exit_code, result.output
    assert isinstance(result.exception, SystemExit), f"unhandled {result.exception!r}"
    error_lines = [line for line in result.stderr.splitlines() if line.startswith("error: ")]
    assert len(error_lines) == 1 and result.stderr.strip().splitlines()[-1] == error_lines[0], result.stderr
    assert fragment in error_lines[0]
    assert "Traceback" not in result.output


# ---- a Kimi-style tiktoken tokenizer ------------------------------------------------------------------------------
# Kimi's pre-tokenizer pattern as published in its checkpoints' tokenization_kimi.py (`TikTokenTokenizer.pat_str`),
# kept here apart from nano's copy so that a slip in either shows up as different ids.
KIMI_PAT_STR = "|".join([
    r"[\p{Han}]+",
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+"
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)?",
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*"
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)?",
    r"\p{N}{1,3}", r" ?[^\s\p{L}\p{N}]+[\r\n]*", r"\s*[\r\n]+", r"\s+(?!\S)", r"\s+",
])
# Kimi K2's named special tokens, by offset from the first special id (163584 in the real checkpoints: [BOS] 163584,
# <|im_end|> 163586, <|im_system|> 163594, <|im_middle|> 163601, [PAD] 163839); the other offsets are reserved.
KIMI_SPECIALS = {
    0: "[BOS]", 1: "[EOS]", 2: "<|im_end|>", 3: "<|im_user|>", 4: "<|im_assistant|>", 6: "<|start_header_id|>",
    7: "<|end_header_id|>", 9: "[EOT]", 10: "<|im_system|>", 11: "<|tool_calls_section_begin|>",
    12: "<|tool_calls_section_end|>", 13: "<|tool_call_begin|>", 14: "<|tool_call_argument_begin|>",
    15: "<|tool_call_end|>", 17: "<|im_middle|>", 254: "[UNK]", 255: "[PAD]",
}
KIMI_CORPUS = [
    "The quick brown fox jumps over the lazy dog. It's what we'll do, isn't it? DON'T, WON'T, CAN'T: THE END.",
    "人工智能正在改变世界。我们的模型可以理解中文和英文。",
    "Съешь же ещё этих мягких французских булок, да выпей чаю.",
    "def add(x, y):\n    return x + y  # 🙂🚀 emoji\n\nprint(add(12345, 678))",
    "Grüße aus München! naïve café déjà vu.",
    "system user assistant: You are Kimi, an AI assistant created by Moonshot AI.",
]


def gpt2_byte_alphabet() -> dict[str, int]:
    """GPT-2's byte-level alphabet (character -> byte), written out here rather than taken from nano: printable
    Latin-1 bytes stand for themselves, the other 68 bytes for U+0100, U+0101, ... in byte order."""
    kept = [*range(33, 127), *range(161, 173), *range(174, 256)]
    moved = [byte for byte in range(256) if byte not in kept]
    alphabet = {chr(byte): byte for byte in kept} | {chr(256 + i): byte for i, byte in enumerate(moved)}
    assert set(alphabet) == set(pre_tokenizers.ByteLevel.alphabet())
    return alphabet


def build_kimi_tiktoken_dir(path: Path, tokenizer_config: dict | None = None,
                            specials: dict[int, str] | None = None) -> tuple[Path, RustTokenizer]:
    """A Kimi-style checkpoint tokenizer (tiktoken.model + tokenizer_config.json) and the same vocabulary as a
    `tokenizers` BPE, the independent encoder to compare with.

    A byte-level BPE is trained with `tokenizers` on KIMI_CORPUS, pre-tokenized with Kimi's pattern (run by
    `tokenizers`' Oniguruma engine). Its vocabulary is written as tiktoken.model, `base64(bytes) id` per line: the
    trainer numbers the 256 bytes first and then each merged token in the order it was created, which is the merge
    priority tiktoken reads from the rank. The 256 ids after the vocabulary are special: `specials` (offset -> name,
    default KIMI_SPECIALS) go into tokenizer_config.json's added_tokens_decoder, and the `tokenizers` BPE gets all
    256, the unnamed ones as `<|reserved_token_{id}|>`. `tokenizer_config` entries are added to the config file.
    """
    import base64   # imported here so that this section stays a pure append to the file
    from tokenizers import Regex

    path.mkdir(parents=True, exist_ok=True)
    tok = RustTokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(KIMI_PAT_STR), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=1000, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(KIMI_CORPUS * 3, trainer)
    alphabet = gpt2_byte_alphabet()
    vocab = sorted(tok.get_vocab().items(), key=lambda item: item[1])
    assert [i for _, i in vocab] == list(range(len(vocab)))
    lines = [f"{base64.b64encode(bytes(alphabet[c] for c in token)).decode()} {i}" for token, i in vocab]
    (path / "tiktoken.model").write_text("\n".join(lines) + "\n")
    base = len(vocab)
    named = {base + offset: name for offset, name in (KIMI_SPECIALS if specials is None else specials).items()}
    tok.add_special_tokens([named.get(i, f"<|reserved_token_{i}|>") for i in range(base, base + 256)])
    config = {"tokenizer_class": "TikTokenTokenizer", "bos_token": "[BOS]", "eos_token": "[EOS]",
              "added_tokens_decoder": {str(i): {"content": name, "special": True} for i, name in named.items()},
              **(tokenizer_config or {})}
    (path / "tokenizer_config.json").write_text(json.dumps(config))
    return path, tok


def listening_addresses(port: int) -> set[str]:
    """The local addresses with a LISTEN socket on `port` (from /proc/net/tcp and tcp6, hex as the kernel writes)."""
    found = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for line in Path(table).read_text().splitlines()[1:]:
            local, state = line.split()[1], line.split()[3]
            if state == "0A" and int(local.rsplit(":", 1)[1], 16) == port:
                found.add(local.rsplit(":", 1)[0])
    return found
