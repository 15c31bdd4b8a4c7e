"""Weight formats at run time: INT4 packing bit-exact with the checkpoint layout, the INT4 matmul, and models
whose weights are converted in place."""

import pytest
import torch
from fixtures import dequantize_fp8_reference, pack_int4
from fixtures import quantize_fp8_block as independent_fp8_block

from nano import LLM, SamplingParams
from nano.errors import NanoError
from nano.config import ModelConfig
from nano.model import Transformer
from nano.presets import PRESETS
from nano.quant import (Fp8Linear, Int4Linear, PhaseLinear, convert_weights, not_converted, quantize_fp8_block,
                        quantize_int4, unpack_int4, weight_bytes_by_format)


@pytest.mark.parametrize("n,k,group", [(64, 256, 32), (48, 128, 64), (32, 256, 128)])
def test_quantize_int4_is_bit_exact_with_the_independent_packer(n, k, group):
    w = torch.randn(n, k, generator=torch.Generator().manual_seed(n + k))
    packed, scale = quantize_int4(w, group)
    want_packed, want_scale, _, reference = pack_int4(w, group)
    assert torch.equal(packed, want_packed) and torch.equal(scale, want_scale)
    torch.testing.assert_close(unpack_int4(packed, scale, (n, k), group), reference, rtol=0, atol=0)


@pytest.mark.parametrize("n,k,dtype", [(256, 512, torch.bfloat16), (200, 96, torch.bfloat16),
                                       (256, 512, torch.float32)])   # CPU int4 kernel; two unpacking paths
def test_int4_linear_matches_dequantize_then_matmul(n, k, dtype):
    w = torch.randn(n, k).to(dtype)
    linear = Int4Linear.from_float(w, 32)
    assert linear.cpu_tiled == (n % 16 == 0 and dtype == torch.bfloat16)
    deq = unpack_int4(*quantize_int4(w, 32), (n, k), 32)
    for m in (1, 7, 64):
        x = torch.randn(m, k).to(dtype)
        want = x.double() @ deq.double().t()
        got = linear(x).double()
        assert ((got - want).abs().max() / want.abs().max()).item() < (1e-2 if dtype == torch.bfloat16 else 1e-5)


def test_fp8_block_round_trip_is_close():
    w = torch.randn(300, 200)
    q, scale_inv = quantize_fp8_block(w)
    assert q.dtype == torch.float8_e4m3fn and scale_inv.shape == (3, 2)
    restored = q.float() * scale_inv.repeat_interleave(128, 0)[:300].repeat_interleave(128, 1)[:, :200]
    assert ((restored - w).norm() / w.norm()).item() < 0.05


def test_fp8_block_quantizer_agrees_with_the_independent_one():
    w = torch.randn(300, 200, generator=torch.Generator().manual_seed(3))
    q, scale_inv = quantize_fp8_block(w)
    want_q, want_scale = independent_fp8_block(w)
    assert torch.equal(q.view(torch.uint8), want_q.view(torch.uint8)) and torch.equal(scale_inv, want_scale)


@pytest.mark.parametrize("n,k,block,dtype", [(136, 200, (128, 128), torch.float32),     # partial blocks
                                             (256, 512, (128, 128), torch.bfloat16),
                                             (40, 50, (16, 32), torch.float32)])
def test_fp8_linear_matches_dequantize_then_matmul(n, k, block, dtype):
    """The CPU path (dequantize the resident codes, then multiply) against float64 arithmetic on the values the
    codes stand for, with a bias; e4m3 subnormal and negative codes included."""
    gen = torch.Generator().manual_seed(n * k)
    q, scale_inv = independent_fp8_block(torch.randn(n, k, generator=gen), block)
    q.view(torch.uint8)[0, :16] = torch.tensor([0, 1, 2, 7, 8, 0x80, 0x81, 0x87, 0x88, 0x7E, 0xFE, 0x40, 0xC0,
                                                 0x38, 0xB8, 0x01], dtype=torch.uint8)
    bias = torch.randn(n, generator=gen).to(dtype)
    linear = Fp8Linear(q, scale_inv, block, bias)
    assert linear.weight.dtype == torch.float8_e4m3fn and linear.weight.data_ptr() == q.data_ptr()
    values = dequantize_fp8_reference(q, scale_inv, block).double()
    for m in (1, 5, 33):
        x = torch.randn(m, k, generator=gen).to(dtype)
        want = x.double() @ values.t() + bias.double()
        got = linear(x).double()
        assert got.dtype == torch.float64 and linear(x).dtype == dtype
        assert ((got - want).abs().max() / want.abs().max()).item() < (1e-2 if dtype == torch.bfloat16 else 1e-6)


def test_fp8_weights_are_resident_at_half_the_bf16_bytes_and_exact_to_their_values(tiny_glm5):
    """`--weights fp8` holds every Linear but the lm_head, kv_b_proj and the indexer's weights_proj as FP8 blocks
    (the release's choice), 0.50x their BF16 bytes plus a scale per block, and computes exactly what a float model
    holding the dequantized values computes."""
    ids = list(range(1, 120))
    bf16 = LLM(str(tiny_glm5), dtype="bfloat16", kv_budget="16MiB", progress=False)
    fp8 = LLM(str(tiny_glm5), weights="fp8", dtype="bfloat16", kv_budget="16MiB", progress=False)
    linears = {name: m for name, m in bf16.model.named_modules() if isinstance(m, torch.nn.Linear)}
    quantized = {name: m for name, m in fp8.model.named_modules() if isinstance(m, Fp8Linear)}
    assert set(quantized) == {n for n in linears if not n.endswith(("lm_head", "kv_b_proj", "weights_proj"))}
    bf16_bytes = sum(linears[n].weight.numel() * 2 for n in quantized)
    assert 0.50 <= weight_bytes_by_format(fp8.model)["fp8"] / bf16_bytes <= 0.501
    # the rest stays as the bf16 model holds it (widened to fp32 on a CPU without bf16 matmuls: llm.compute_dtype)
    held, size = ("bf16", 2) if bf16.compute_dtype == torch.bfloat16 else ("fp32", 4)
    assert fp8.weight_bytes()[held] == bf16.weight_bytes()[held] - bf16_bytes // 2 * size
    # exactness, in fp32: the FP8 model against a float model holding the dequantized values
    fp8_32 = LLM(str(tiny_glm5), weights="fp8", kv_budget="16MiB", progress=False)
    reference = LLM(str(tiny_glm5), kv_budget="16MiB", progress=False)
    for name, module in fp8_32.model.named_modules():
        if isinstance(module, Fp8Linear):
            reference.model.get_submodule(name).weight.data.copy_(dequantize_fp8_reference(
                module.weight, module.weight_scale_inv, module.block_size))
    got, want = fp8_32.score(ids).double(), reference.score(ids).double()
    assert ((got - want).abs().amax(-1) / want.abs().amax(-1)).max() < 1e-4


def test_fp8_prefill_with_int4_decode_holds_both_where_asked(tiny_glm5):
    """The report's GLM-5.2 policy: FP8 for prefill, INT4 experts for decode. Each phase's format covers what it
    touches and leaves the rest as loaded: from a BF16 model, attention holds FP8 (prefill) and BF16 (decode);
    from an FP8 release one FP8 copy serves both. Each phase runs only its own side."""
    prompt = [[3, 1, 4, 1, 5, 9, 2, 6] * 5]
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    llm = LLM(str(tiny_glm5), prefill_weights="fp8", decode_weights="int4", kv_budget="16MiB", progress=False)
    fp8 = LLM(str(tiny_glm5), weights="fp8", kv_budget="16MiB", progress=False)
    model = llm.model
    expert, attention = (model.get_submodule(f"model.layers.1.{name}")
                         for name in ("mlp.experts.0.up_proj", "self_attn.o_proj"))
    assert isinstance(expert, PhaseLinear) and isinstance(attention, PhaseLinear)
    assert isinstance(expert.prefill, Fp8Linear) and isinstance(expert.decode, Int4Linear)
    assert isinstance(attention.prefill, Fp8Linear) and type(attention.decode) is torch.nn.Linear
    held = llm.weight_bytes()
    assert held["fp8"] == fp8.weight_bytes()["fp8"] and held["int4"] > 0
    # an FP8 release (here: the FP8 model) keeps one FP8 copy of what decode does not convert
    release = fp8.model
    convert_weights(release, "fp8", "int4", torch.float32)
    assert isinstance(release.get_submodule("model.layers.1.self_attn.o_proj"), Fp8Linear)
    expert = release.get_submodule("model.layers.1.mlp.experts.0.up_proj")
    assert isinstance(expert.prefill, Fp8Linear) and isinstance(expert.decode, Int4Linear)
    calls: list[tuple[str, bool]] = []
    passes: list[bool] = []
    model.register_forward_pre_hook(lambda _, args: passes.append(args[2].decode))
    for module in model.modules():
        if isinstance(module, PhaseLinear):
            module.prefill.register_forward_hook(lambda *_: calls.append(("fp8", passes[-1])))
            module.decode.register_forward_hook(lambda *_: calls.append(("int4", passes[-1])))
    got = llm.generate(prompt, params)[0].token_ids
    assert {fmt for fmt, decode in calls if not decode} == {"fp8"}
    assert {fmt for fmt, decode in calls if decode} == {"int4"}
    assert got[0] == fp8.generate(prompt, params)[0].token_ids[0]          # the first token comes from prefill


def test_a_checkpoints_unquantized_modules_are_never_converted():
    assert not_converted("model.layers.1.self_attn.q_a_proj", ["re:.*self_attn.*"])
    assert not_converted("lm_head", ["lm_head"]) and not_converted("model.layers.0.mlp.down_proj", ["mlp"])
    assert not not_converted("model.layers.0.mlp.down_proj", ["mlp.down", "re:self_attn"])
    model = Transformer(ModelConfig.from_hf(PRESETS["glm-5.2"].nano_config))
    model.init_random(0)
    convert_weights(model, "fp8", "fp8", torch.float32, keep=["re:.*self_attn.*", "shared_experts"])
    kinds = {name: type(m) for name, m in model.named_modules() if isinstance(m, (torch.nn.Linear, Fp8Linear))}
    assert all(kind is torch.nn.Linear for name, kind in kinds.items() if "self_attn" in name or "shared" in name)
    assert kinds["model.layers.1.mlp.experts.0.gate_proj"] is Fp8Linear


def test_int4_experts_are_under_a_third_of_their_bf16_bytes_and_stay_accurate(tiny_glm5):
    ids = list(range(1, 200))
    bf16 = LLM(str(tiny_glm5), kv_budget="16MiB", progress=False)
    int4 = LLM(str(tiny_glm5), weights="int4", kv_budget="16MiB", progress=False)
    routed = sum(p.numel() for n, p in bf16.model.named_parameters() if ".mlp.experts." in n)
    assert weight_bytes_by_format(int4.model)["int4"] <= 0.30 * routed * 2
    # the INT4 model against a float model holding exactly the dequantized INT4 weights
    reference = LLM(str(tiny_glm5), kv_budget="16MiB", progress=False)
    for name, module in int4.model.named_modules():
        if isinstance(module, Int4Linear):
            reference.model.get_submodule(name).weight.data.copy_(module.dequantized())
    got, want, base = (llm.score(ids).double() for llm in (int4, reference, bf16))
    assert ((got - want).abs().amax(-1) / want.abs().amax(-1)).max() < 1e-4   # fp32: the fixture tolerance
    kl = (base.softmax(-1) * (base.log_softmax(-1) - got.log_softmax(-1))).sum(-1).mean()
    print(f"INT4 routed experts vs unquantized weights: mean KL {kl:.2e} over {len(ids)} positions")


def test_bad_weight_format():
    with pytest.raises(NanoError, match="weights int3: neither a weight format .* nor an existing checkpoint"):
        LLM("kimi-k2.6-random", weights="int3", kv_budget="16MiB", progress=False)
    with pytest.raises(NanoError, match="decode_weights must be one of auto, bf16, fp8, int4; got 'int3'"):
        LLM("kimi-k2.6-random", decode_weights="int3", kv_budget="16MiB", progress=False)


def test_prefill_and_decode_can_use_different_weights(tiny_glm5):
    """BF16 prefill + INT4 decode: the prefill step runs only BF16 experts, decode steps only INT4 ones, the first
    token (from prefill) is the BF16 model's, and both formats stay resident."""
    prompt = [[3, 1, 4, 1, 5, 9, 2, 6] * 5]
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    bf16 = LLM(str(tiny_glm5), weights="bf16", kv_budget="16MiB", progress=False)
    split = LLM(str(tiny_glm5), prefill_weights="bf16", decode_weights="int4", kv_budget="16MiB", progress=False)
    calls: list[tuple[str, bool]] = []
    passes: list[bool] = []   # each forward pass's batch: decode or not
    split.model.register_forward_pre_hook(lambda _, args: passes.append(args[2].decode))
    for module in split.model.modules():
        if isinstance(module, PhaseLinear):
            module.prefill.register_forward_hook(lambda *_: calls.append(("bf16", passes[-1])))
            module.decode.register_forward_hook(lambda *_: calls.append(("int4", passes[-1])))
    got = split.generate(prompt, params)[0].token_ids
    assert got[0] == bf16.generate(prompt, params)[0].token_ids[0]
    assert {fmt for fmt, decode in calls if not decode} == {"bf16"}
    assert {fmt for fmt, decode in calls if decode} == {"int4"}
    assert set(split.weight_bytes()) == {"fp32", "int4"}
    # scoring is prefill, whatever ran last
    torch.testing.assert_close(split.score(prompt[0]), bf16.score(prompt[0]), rtol=0, atol=0)


def test_a_requests_tokens_do_not_depend_on_its_neighbours_with_per_phase_weights(tiny_glm5):
    """BF16 prefill + INT4 decode: a request decodes through the INT4 weights whatever shares its steps — alone,
    beside a long prompt whose prefill chunks run in the same steps, and beside other decodes."""
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    llm = LLM(str(tiny_glm5), prefill_weights="bf16", decode_weights="int4", kv_budget="16MiB", max_step_tokens=64,
              progress=False)
    prompt = [3, 1, 4, 1, 5, 9, 2, 6] * 3
    alone = llm.generate([prompt], params)[0].token_ids

    request = llm.submit(prompt, params)
    llm.poll()                                                   # its prefill: it decodes from the next step on
    long_prompt = llm.submit([(7 * i) % 250 for i in range(400)], SamplingParams(temperature=0, max_tokens=2))
    mixed_steps = 0
    while llm.engine.has_work():
        mixed_steps += not request.finished and long_prompt.num_cached < len(long_prompt.prompt_token_ids)
        llm.poll()
    assert mixed_steps >= 5                                      # 400 tokens in 64-token chunks beside its decodes
    assert request.output_token_ids == alone

    beside_decodes = llm.generate([[2, 7, 1, 8] * 5, prompt, [1, 6, 1, 8] * 4], params)
    assert beside_decodes[1].token_ids == alone
