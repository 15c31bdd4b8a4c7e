"""nano against transformers on tiny random checkpoints and on the trained stand-ins: teacher-forced logits and
greedy generation.

Each fixture is a real Hugging Face checkpoint written by transformers' own classes; nano loads it from disk
through its loader and runs it through the engine's cache path (chunked prefill, then one token per step)."""
import contextlib
from collections.abc import Iterator
from pathlib import Path
from unittest import mock

import pytest
import torch
from fixtures import (TINY, TINY_INDEXER, build_tokenizer_dir, convert_to_fp8_block, convert_to_int4_ct,
                      make_kimi_k25, read_config, read_tensors, tiny_hf_model, write_checkpoint)

from nano import LLM, SamplingParams
from nano.config import ModelConfig
from nano.loader import STANDINS
from nano.model import Indexer, rope_frequencies
from nano.quant import Fp8Linear

KIMI_YARN = {"rope_type": "yarn", "rope_theta": 50000.0, "factor": 32.0, "original_max_position_embeddings": 32,
             "beta_fast": 1.0, "beta_slow": 1.0, "mscale": 1.0, "mscale_all_dim": 1.0}
FIXTURES = {
    # Kimi K2.x: DeepSeek-V3 with YaRN x32, beta_fast = beta_slow = 1 and the mscale-corrected softmax scale
    "kimi-yarn": ("deepseek_v3", dict(rope_parameters=KIMI_YARN, n_routed_experts=8, num_experts_per_tok=3)),
    # group-limited routing: 8 experts in 4 groups, the best 2 groups compete
    "kimi-groups": ("deepseek_v3", dict(n_routed_experts=8, num_experts_per_tok=2, n_group=4, topk_group=2)),
    # Moonlight: no q_lora, split-half RoPE layout
    "moonlight": ("deepseek_v3", dict(q_lora_rank=None, rope_interleave=False, n_shared_experts=2)),
    # GLM-5: DSA indexer picking 16 of up to 80 keys; layers 1 and 3 reuse the previous full layer's choice
    "glm5-dsa": ("glm_moe_dsa", dict(num_hidden_layers=4, index_topk=16, index_n_heads=8,
                                     indexer_types=["full", "shared", "full", "shared"],
                                     rope_parameters={"rope_type": "default", "rope_theta": 8e6})),
    "glm4.7-flash": ("glm4_moe_lite", dict(rope_parameters={"rope_type": "default", "rope_theta": 1e6})),
}
# The trained stand-ins nano ships (tools/train_standin.py), fed held-out text: the GLM one's indexer picks 64 keys,
# so from position 64 on its attention is sparse.
TRAINED = ["glm-5.2", "kimi-k2.6"]
POSITIONS = 80   # teacher-forced positions compared (>= 64)
NEW_TOKENS = 32


@pytest.fixture(scope="module", params=list(FIXTURES) + [f"trained {name}" for name in TRAINED])
def pair(request, tmp_path_factory) -> tuple[torch.nn.Module, Path]:
    if request.param.startswith("trained "):
        from transformers import AutoModelForCausalLM

        ckpt = STANDINS / request.param.removeprefix("trained ")
        return AutoModelForCausalLM.from_pretrained(ckpt, dtype=torch.float32).eval(), ckpt
    model_type, overrides = FIXTURES[request.param]
    hf = tiny_hf_model(model_type, seed=3, **overrides)
    ckpt = tmp_path_factory.mktemp(request.param)
    hf.save_pretrained(ckpt)
    build_tokenizer_dir(ckpt)
    return hf, ckpt


@contextlib.contextmanager
def ties_by_position() -> Iterator[None]:
    """Make transformers' `Tensor.topk` (its DSA indexer's pick) break ties by position, as nano's stable sort does.

    The indexer's score is a weighted sum of ReLUs, so every key whose heads are all relu'd to 0 scores exactly 0:
    trained weights give runs of such ties, and the k-th place often falls inside one. torch.topk leaves the order
    of equal values unspecified, so without a rule the oracle itself has no single answer there."""
    def stable_topk(self: torch.Tensor, k: int, dim: int = -1, largest: bool = True, sorted: bool = True):
        order = self.sort(dim=dim, descending=largest, stable=True)
        return torch.return_types.topk((order.values.narrow(dim, 0, k), order.indices.narrow(dim, 0, k)))

    with mock.patch.object(torch.Tensor, "topk", stable_topk):
        yield


def relative_error(got: torch.Tensor, want: torch.Tensor) -> float:
    """Worst position's max |difference| relative to that position's largest |logit|."""
    return ((got - want).abs().amax(-1) / want.abs().amax(-1)).max().item()


def prompt(ckpt: Path, vocab: int, length: int, seed: int = 0) -> list[int]:
    """Random ids for a random model; for a trained stand-in, its tokens of the held-out text (at an offset)."""
    if ckpt.parent == STANDINS:
        from tokenizers import Tokenizer

        ids = Tokenizer.from_file(str(ckpt / "tokenizer.json")).encode((STANDINS / "heldout.txt").read_text()).ids
        return ids[1000 * seed:1000 * seed + length]
    return torch.randint(0, vocab, (length,), generator=torch.Generator().manual_seed(seed)).tolist()


def test_teacher_forced_logits_match(pair):
    hf, ckpt = pair
    ids = prompt(ckpt, hf.config.vocab_size, POSITIONS)
    with torch.no_grad(), ties_by_position():
        want = hf(torch.tensor([ids])).logits[0].float()
    llm = LLM(str(ckpt), dtype="float32", max_step_tokens=24, progress=False)  # 4 chunks, each reading the others
    assert relative_error(llm.score(ids), want) <= 1e-4


def test_greedy_generation_matches(pair):
    hf, ckpt = pair
    ids = prompt(ckpt, hf.config.vocab_size, 40, seed=1)
    want = list(ids)
    with torch.no_grad(), ties_by_position():  # the reference recomputes the whole sequence every step: no cache
        for _ in range(NEW_TOKENS):
            want.append(int(hf(torch.tensor([want])).logits[0, -1].argmax()))
    llm = LLM(str(ckpt), dtype="float32", max_step_tokens=16, progress=False)
    out = llm.generate([ids], SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True))[0]
    assert out.token_ids == want[len(ids):]


@pytest.mark.parametrize("layout", ["fp8-block", "int4-compressed-tensors", "kimi-k25"])
def test_released_formats_load_and_match_their_dequantized_reference(layout, tmp_path):
    """A checkpoint rewritten in a release format must run exactly like transformers given the same values."""
    hf = tiny_hf_model("deepseek_v3", seed=4, rope_parameters=KIMI_YARN)
    src = tmp_path / "src"
    hf.save_pretrained(src)
    build_tokenizer_dir(src)
    dst = tmp_path / layout
    if layout == "fp8-block":
        reference = convert_to_fp8_block(src, dst)
    elif layout == "int4-compressed-tensors":
        reference = convert_to_int4_ct(src, dst)
    else:
        make_kimi_k25(src, dst)
        reference = None
    if reference is not None:  # transformers gets the values the quantized checkpoint stands for
        hf = type(hf).from_pretrained(write_checkpoint(tmp_path / "reference", reference, read_config(src), src))
    ids = prompt(dst, hf.config.vocab_size, POSITIONS, seed=2)
    with torch.no_grad():
        want = hf(torch.tensor([ids])).logits[0].float()
    llm = LLM(str(dst), progress=False)
    assert relative_error(llm.score(ids), want) <= 1e-4
    if layout == "fp8-block":   # ran on the FP8 codes as the checkpoint stores them, not on a BF16 copy
        stored = read_tensors(dst)
        fp8 = {name: m for name, m in llm.model.named_modules() if isinstance(m, Fp8Linear)}
        assert {f"{name}.weight" for name in fp8} == {
            name for name, t in stored.items() if t.dtype == torch.float8_e4m3fn and "kv_b_proj" not in name}
        for name, module in fp8.items():
            assert torch.equal(module.weight.view(torch.uint8), stored[f"{name}.weight"].view(torch.uint8))


@pytest.mark.parametrize("reference", ["glm_moe_dsa", "deepseek_v32"])
def test_the_indexer_rotates_in_its_own_layout_as_the_reference_indexer(reference):
    """MLA interleaves its rope dims in both families; the indexer does in GLM-5 (transformers' GlmMoeDsaIndexer)
    but splits them in halves in DeepSeek-V3.2 (DeepseekV32Indexer). nano's indexer, given the same weights and the
    reference's layout (`indexer_rope_interleave`, MLA's `rope_interleave` left on), picks the same keys for every
    query, and the other layout picks other keys: the setting is read, and it matters."""
    from transformers.models.deepseek_v32.modeling_deepseek_v32 import DeepseekV32Config, DeepseekV32Indexer
    from transformers.models.glm_moe_dsa.modeling_glm_moe_dsa import GlmMoeDsaConfig, GlmMoeDsaIndexer

    config_class, indexer_class = {"glm_moe_dsa": (GlmMoeDsaConfig, GlmMoeDsaIndexer),
                                   "deepseek_v32": (DeepseekV32Config, DeepseekV32Indexer)}[reference]
    hf_config = config_class(**{**TINY, **TINY_INDEXER, "index_n_heads": 4})
    torch.manual_seed(0)
    want_indexer = indexer_class(hf_config, layer_idx=0).eval()
    seq = 48
    x, q_latent = torch.randn(1, seq, TINY["hidden_size"]), torch.randn(1, seq, TINY["q_lora_rank"])
    allowed = torch.ones(seq, seq, dtype=torch.bool).tril()[None]                      # [1, S, S] causal
    raw = {**GlmMoeDsaConfig(**{**TINY, **TINY_INDEXER, "index_n_heads": 4}).to_dict(), "model_type": "glm_moe_dsa"}
    picks = {}
    for interleave in (True, False):
        cfg = ModelConfig.from_hf({**raw, "indexer_rope_interleave": interleave})
        assert cfg.rope_interleave and cfg.indexer_rope_interleave == interleave
        indexer = Indexer(cfg)
        indexer.load_state_dict(want_indexer.state_dict())
        inv_freq, amplitude = rope_frequencies(cfg)
        freqs = torch.arange(seq, dtype=torch.float32)[:, None] * inv_freq                # [S, R/2]
        cos, sin = freqs.cos() * amplitude, freqs.sin() * amplitude
        with torch.no_grad():
            picks[interleave] = indexer.select(x, q_latent, cos[None], sin[None], indexer.keys(x[0], cos, sin)[None],
                                               allowed)                                 # [1, S, S]
    emb = torch.cat([freqs, freqs], -1)[None]                                           # transformers' [1, S, R]
    with torch.no_grad(), ties_by_position():
        top = want_indexer(x, q_latent, (emb.cos(), emb.sin()), allowed, torch.arange(seq)[None])   # [1, S, k]
    want = torch.zeros_like(allowed).scatter_(-1, top.long(), True) & allowed
    own = reference == "glm_moe_dsa"
    assert torch.equal(picks[own], want)
    assert not torch.equal(picks[not own], want)
