"""The LLM API on the nano preset: batching, streaming, scoring and stopping agree with each other."""
import json
import re

import pytest
import torch
from fixtures import assert_user_error
from tokenizers import Tokenizer as RustTokenizer
from fixtures import nano as run_nano   # `nano` is the package here

import nano.llm
from nano import LLM, NanoError, SamplingParams
from nano.disagg import SplitLLM
from nano.engine import EngineConfig
from nano.llm import resolve_config

FP32_BYTES_PER_TOKEN = resolve_config("glm-5.2-random")[1].kv_bytes_per_token("fp32")


@pytest.fixture(scope="module")
def llm() -> LLM:
    return LLM("glm-5.2-random", max_step_tokens=48, progress=False)


def prompts(llm: LLM) -> list[list[int]]:
    gen = torch.Generator().manual_seed(1)
    return [torch.randint(0, 256, (n,), generator=gen).tolist() for n in (1, 7, 60, 130)]


def test_batched_generation_equals_one_at_a_time(llm):
    greedy = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    together = llm.generate(prompts(llm), greedy)
    alone = [llm.generate([p], greedy)[0] for p in prompts(llm)]
    assert [o.token_ids for o in together] == [o.token_ids for o in alone]
    assert all(o.finish_reason == "length" and len(o.token_ids) == 12 for o in together)


def test_stream_yields_the_request_as_it_grows(llm):
    """One snapshot per token, each a prefix of what generate() returns for the same request, the finished one
    last and equal to it (tokens, text, finish reason)."""
    params = SamplingParams(temperature=0.8, seed=5, max_tokens=10, ignore_eos=True)
    *running, final = llm.stream(prompts(llm)[2], params)
    whole = llm.generate([prompts(llm)[2]], params)[0]
    assert (final.token_ids, final.text, final.finish_reason) == (whole.token_ids, whole.text, "length")
    assert [len(o.token_ids) for o in running] == list(range(1, 10))
    assert all(o.finish_reason is None and whole.token_ids[:len(o.token_ids)] == o.token_ids
               and whole.text.startswith(o.text) for o in running)


def test_score_reproduces_greedy_decoding(llm):
    """Teacher-forcing the greedy continuation through chunked prefill picks the same argmax at every step."""
    prompt = prompts(llm)[3]
    out = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=16, ignore_eos=True))[0]
    logits = llm.score(prompt + out.token_ids)
    assert logits.shape == (len(prompt) + 16, llm.config.vocab_size)
    assert logits[len(prompt) - 1:-1].argmax(-1).tolist() == out.token_ids


def test_seeds_make_sampling_reproducible(llm):
    def run(seed):
        return llm.generate([prompts(llm)[1]], SamplingParams(temperature=1.0, seed=seed, max_tokens=16,
                                                              ignore_eos=True))[0].token_ids
    assert run(3) == run(3)
    assert run(3) != run(4)


def test_stop_token_ends_the_request_and_is_not_in_the_text(llm):
    greedy = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    first = llm.generate([prompts(llm)[2]], greedy)[0].token_ids
    stop_at = first[4]
    out = llm.generate([prompts(llm)[2]], SamplingParams(temperature=0, max_tokens=12, ignore_eos=True,
                                                         stop_token_ids=[stop_at]))[0]
    assert out.finish_reason == "stop"
    assert out.token_ids == first[: first.index(stop_at) + 1]
    assert out.text == llm.tokenizer.decode(out.token_ids[:-1])
    assert out.metrics["completion_tokens"] == len(out.token_ids) and out.metrics["ttft_s"] > 0


@pytest.mark.parametrize("prompt,message", [
    ("", "empty"), ([], "empty"), ([1, 2, 10**6], "outside the vocabulary"), ([0.5], "token ids"),
    ("x" * 5000, "context"),
])
def test_bad_prompts_are_rejected(llm, prompt, message):
    with pytest.raises(NanoError, match=message):
        llm.generate([prompt], SamplingParams(max_tokens=2))


def test_bad_dtype_is_rejected():
    with pytest.raises(NanoError, match="dtype"):
        LLM("glm-5.2-random", dtype="int3", progress=False)


def test_a_stream_closed_early_frees_its_pages(llm):
    stream = llm.stream([1, 2, 3] * 30, SamplingParams(temperature=0, max_tokens=50, ignore_eos=True))
    assert [next(stream) for _ in range(3)]
    stream.close()
    assert llm.last_request.finish_reason == "abort" and len(llm.last_request.output_token_ids) == 3
    assert not llm.engine.has_work() and llm.engine.scheduler.allocator.num_free == llm.pool.num_pages


@pytest.mark.parametrize("settings, message", [
    (dict(kv_dtype="fp4"), "kv_dtype must be one of auto, fp32, bf16, fp8; got 'fp4'"),
    (dict(page_size=0), "page_size must be at least 1; got 0"),
    (dict(int4_all=True, weights="fp8"), "int4_all needs int4 weights"),
    (dict(decode_kernel="cuda"), "decode_kernel must be one of auto, triton, torch; got 'cuda'"),
    (dict(kv_budget="lots"), "kv_budget: cannot read the size 'lots'"),
    (dict(dtype="float16"), "dtype must be one of float32, fp32, bfloat16, bf16; got 'float16'"),
    (dict(kv_dtyp="fp8"), "no engine setting 'kv_dtyp'"),
])
def test_engine_settings_are_refused_before_anything_loads(settings, message, monkeypatch):
    monkeypatch.setattr(nano.llm, "resolve_config", lambda *_: pytest.fail("the model was looked up before the check"))
    with pytest.raises(NanoError, match=re.escape(message)):
        LLM("glm-5.2-random", **settings)


def test_one_engine_config_reaches_the_engine_and_each_split_worker():
    config = EngineConfig(kv_dtype="fp8", max_running=3, max_step_tokens=40, page_size=16, kv_budget="8MiB")
    llm = LLM("glm-5.2-random", config, progress=False)
    assert llm.engine_config == config and llm.pool.kv_dtype == "fp8" and llm.pool.page_size == 16
    assert (llm.engine.scheduler.max_running, llm.engine.max_step_tokens) == (3, 40)
    # the split's workers: the production formats unless told (BF16 prefill with its KV, INT4 decode with FP8 KV),
    # the prefix cache on the prefill side only, every other setting as given
    workers = SplitLLM.worker_configs(config.replace(threads=1), "bf16", "fp8")
    assert {role: (c.prefill_weights, c.decode_weights, c.kv_dtype, c.prefix_cache) for role, c in workers.items()} \
        == {"prefill": ("bf16", "bf16", "bf16", True), "decode": ("int4", "int4", "fp8", False)}
    assert all((c.max_running, c.page_size, c.kv_budget, c.threads) == (3, 16, "8MiB", 1) for c in workers.values())
    with pytest.raises(NanoError, match="int4_all needs int4 weights in a worker"):
        SplitLLM.worker_configs(config.replace(int4_all=True, weights="fp8"), "bf16", "fp8")


@pytest.mark.parametrize("threads", [0, 10_000])
def test_threads_outside_the_cores_are_refused(threads):
    with pytest.raises(NanoError, match="threads must be between 1 and"):
        LLM("glm-5.2-random", threads=threads, progress=False)


def test_mlp_runs_gate_and_up_as_one_matmul_over_views_of_one_tensor():
    """The fused [gate; up] matmul gives what two separate projections give (a float64 reference), holds the
    weights once (the parameters are views of it), and is rebuilt when a weight is replaced (as a loader does)."""
    from nano.model import MLP

    mlp = MLP(16, 8)
    for param in mlp.parameters():
        param.data.normal_()
    x = torch.randn(5, 16)
    expected = lambda: (torch.nn.functional.silu(x.double() @ mlp.gate_proj.weight.double().T)
                        * (x.double() @ mlp.up_proj.weight.double().T)) @ mlp.down_proj.weight.double().T
    reference = expected()
    assert torch.allclose(mlp(x).double(), reference, rtol=1e-5, atol=1e-5)
    fused = mlp.gate_up()
    assert mlp.gate_proj.weight.data_ptr() == fused.data_ptr() and fused.shape == (16, 16)
    assert mlp.up_proj.weight.data_ptr() == fused[8:].data_ptr()
    mlp.up_proj.weight = torch.nn.Parameter(torch.randn(8, 16), requires_grad=False)   # a new tensor
    assert not torch.allclose(expected(), reference) and torch.allclose(mlp(x).double(), expected(), rtol=1e-5,
                                                                         atol=1e-5)


def test_bfloat16_on_a_cpu_without_bf16_matmuls_is_the_bf16_model_computed_in_float32(monkeypatch):
    """Without AVX512-BF16 or AMX, a bfloat16 model keeps its bf16 weight values and bf16 KV pages but multiplies in
    float32: the same logits, bit for bit, as a float32 model given those weights (rounded to bf16 independently,
    routers left fp32 as the reference keeps them) and bf16 KV pages. With a bf16 unit, or on a GPU, it stays bf16."""
    monkeypatch.setattr(torch.cpu, "_is_avx512_bf16_supported", lambda: False)
    monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: False)
    bf16 = LLM("glm-5.2-random", dtype="bfloat16", kv_budget="4MiB", progress=False)
    assert bf16.compute_dtype == torch.float32 and bf16.pool.kv_dtype == "bf16"
    assert {p.dtype for p in bf16.model.parameters()} == {torch.float32}
    reference = LLM("glm-5.2-random", dtype="float32", kv_dtype="bf16", kv_budget="4MiB", progress=False)
    for name, param in reference.model.named_parameters():
        if not name.endswith(("mlp.gate.weight", "e_score_correction_bias")):
            param.data = param.data.to(torch.bfloat16).float()
    ids = list(range(3, 60))
    assert torch.equal(bf16.score(ids), reference.score(ids))
    assert bf16.counters()["compute_dtype"] == "float32"

    monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: True)
    native = LLM("glm-5.2-random", dtype="bfloat16", kv_budget="4MiB", progress=False)
    assert native.compute_dtype == torch.bfloat16 and native.model.lm_head.weight.dtype == torch.bfloat16


def test_a_request_the_pool_can_never_hold_is_refused_up_front():
    """prompt + max_tokens over the KV pool (here 128 tokens, under the 4,096-token context): NanoError before
    anything runs, naming the sizes, for submit, generate (none of its prompts queued) and stream. One that fills
    the pool exactly runs to the end."""
    small = LLM("glm-5.2-random", page_size=16, kv_budget=8 * 16 * FP32_BYTES_PER_TOKEN, progress=False)
    assert small.pool.tokens == small.max_request_tokens == 128 < small.max_context
    prompt = list(range(1, 21))
    message = re.escape("prompt 1 (20 tokens) + max_tokens (109) is more than the KV pool holds (128 tokens): use "
                        "max_tokens 108 or less or a bigger --kv-budget")
    too_long = SamplingParams(temperature=0, max_tokens=109, ignore_eos=True)
    with pytest.raises(NanoError, match=message):
        small.generate([[5, 6], prompt], too_long)
    assert not small.engine.has_work()
    with pytest.raises(NanoError, match=re.escape("prompt (128 tokens) + max_tokens (1) is more than the KV pool holds "
                                                  "(128 tokens): use a shorter prompt or a bigger --kv-budget")):
        small.submit(list(range(1, 129)), SamplingParams(max_tokens=1))
    with pytest.raises(NanoError, match="max_tokens 108 or less"):
        next(small.stream(prompt, too_long))
    full = small.generate([prompt], SamplingParams(temperature=0, max_tokens=108, ignore_eos=True))[0]
    assert full.finish_reason == "length" and len(full.token_ids) == 108
    assert small.health() is None   # one device: nothing else to be alive


# The ends of a turn of each trained stand-in, named: those of its family (the end of text, of the turn, or another
# role's turn starting, as real GLM-5 ends a turn at <|user|> / <|observation|>), and any other role's turn starting.
TURN_ENDS = {"glm-5.2": ["<|endoftext|>", "<|system|>", "<|user|>", "<|assistant|>", "<|observation|>"],
             "kimi-k2.6": ["[EOS]", "<|im_end|>", "<|im_system|>", "<|im_user|>", "<|im_assistant|>"]}


@pytest.fixture(scope="module", params=list(TURN_ENDS))
def stand_in(request: pytest.FixtureRequest) -> tuple[str, LLM, RustTokenizer]:
    """A trained stand-in's name, the stand-in, and its tokenizer.json read by the `tokenizers` library (the
    reference decode)."""
    return (request.param, LLM(request.param, progress=False),
            RustTokenizer.from_file(str(resolve_config(request.param)[0].path / "tokenizer.json")))


def test_a_trained_stand_in_s_reply_ends_where_its_turn_ends(stand_in):
    """The stand-ins learned chats rendered by their family's template (tools/train_standin.py): a turn ends at the end
    of text or of the turn, or where another role's turn starts (the trained glm-5.2 answers "hi" with `I am a
    man.<|assistant|>`). The greedy reply is the continuation generated past every end (`ignore_eos`) cut after the
    first of these tokens (named here, looked up in the tokenizer.json), finish "stop"; every text is the
    `tokenizers` library's decode with skip_special_tokens of the ids, which keep the special tokens."""
    model, llm, reference = stand_in
    end_ids = {reference.token_to_id(token) for token in TURN_ENDS[model]}
    prompt = llm.tokenizer.encode_chat([{"role": "user", "content": "hi"}])
    raw = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=16, ignore_eos=True))[0]
    reply = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=16))[0]
    first = next(i for i, token in enumerate(raw.token_ids) if token in end_ids)
    assert (reply.token_ids, reply.finish_reason) == (raw.token_ids[:first + 1], "stop")
    specials = {i for i, token in reference.get_added_tokens_decoder().items() if token.special}
    assert sum(token in specials for token in raw.token_ids) >= 2   # the ids keep them: the end and later turns
    for output in (raw, reply):
        assert output.text == reference.decode(output.token_ids, skip_special_tokens=True)
        assert output.text and "<|" not in output.text and "[EOS]" not in output.text
    if model == "glm-5.2":
        assert reply.token_ids[-1] == reference.token_to_id("<|assistant|>")   # issue 29's reply


def test_a_chat_with_a_trained_stand_in_shows_no_special_token(stand_in):
    """nano chat's turns (interactive and -p: `Conversation.reply`, streamed through LLM.stream), sampled: what is
    shown piece by piece and what joins the conversation is the reference decode, without special tokens, of the
    reply's ids, which end at the turn's end."""
    from nano.cli.chat import Conversation

    _, llm, reference = stand_in
    conversation = Conversation(llm, SamplingParams(temperature=0.7, seed=1, max_tokens=24), None, True)
    for message in ("hi", "The king is dead"):
        shown: list[str] = []
        reply = conversation.reply(message, shown.append)
        assert "".join(shown) == reply.text == reference.decode(reply.token_ids, skip_special_tokens=True)
        assert "<|" not in reply.text and "[EOS]" not in reply.text
        assert reply.finish_reason == "length" or reply.token_ids[-1] in set(llm.tokenizer.eos_token_ids)
    assert [m["content"] for m in conversation.messages if m["role"] == "assistant"][-1] == reply.text


def test_a_reply_whose_tokens_cannot_become_text_ends_alone(llm, monkeypatch):
    """A token the tokenizer fails to decode ends that request with an error (stream and generate), instead of
    raising through the caller's loop; the other request of the batch gets its tokens and text."""
    greedy = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    want = llm.generate(prompts(llm)[1:3], greedy)
    first, other = want[0].token_ids, want[1].token_ids
    index, bad = next((i, t) for i, t in enumerate(first) if i and t not in first[:i] + other)
    decode = llm.tokenizer.decode

    def failing(ids: list[int]) -> str:
        if bad in ids:
            raise ValueError(f"token {bad} has no text")
        return decode(ids)

    monkeypatch.setattr(llm.tokenizer, "decode", failing)
    outs = llm.generate(prompts(llm)[1:3], greedy)
    error = f"'s tokens could not be turned into text: token {bad} has no text"
    assert (outs[0].finish_reason, outs[0].error) == ("abort", f"request {outs[0].request_id}{error}")
    assert (outs[1].token_ids, outs[1].text, outs[1].finish_reason) == (other, want[1].text, "length")
    *running, final = llm.stream(prompts(llm)[1], greedy)
    assert (final.finish_reason, final.error) == ("abort", f"request {final.request_id}{error}")
    assert len(running) == index and final.token_ids == first[:index + 1]   # it stopped at that token
    assert not llm.engine.has_work() and llm.engine.scheduler.allocator.num_free == llm.pool.num_pages


def test_chat_sampling_extremes_end_in_an_error_line_or_a_normal_reply():
    """`nano chat --temperature 1e-38` is a usage error (before the model loads); `--top-p 1e-300` samples: the
    top token alone, so the reply is the greedy one."""
    assert_user_error(run_nano("chat", "glm-5.2-random", "-p", "hi", "--temperature", "1e-38"),
                      "--temperature must be 0 (greedy) or a finite number >= 1e-05, got 1e-38", exit_code=2)
    greedy, tiny_top_p = (run_nano("chat", "glm-5.2-random", "-p", "hello", "--json", "--max-tokens", "6", *flags)
                          for flags in (["--temperature", "0"], ["--top-p", "1e-300"]))
    assert greedy.exit_code == tiny_top_p.exit_code == 0, tiny_top_p.output
    assert json.loads(greedy.stdout)["token_ids"] == json.loads(tiny_top_p.stdout)["token_ids"]


def test_chat_default_max_tokens_fits_the_pool():
    """Without --max-tokens a reply gets at most the room the KV pool leaves (here 64 tokens, under the default 256);
    a --max-tokens asked for that cannot fit is one error line, a usage error as the server's 400."""
    small = ["--page-size", "8", "--kv-budget", str(8 * 8 * FP32_BYTES_PER_TOKEN), "--temperature", "0"]
    result = run_nano("chat", "glm-5.2-random", "-p", "hello", "--json", *small)
    assert result.exit_code == 0, result.output
    reply = json.loads(result.stdout)
    completion, room = reply["completion_tokens"], 64 - reply["prompt_tokens"]
    assert completion == room or (completion < room and reply["finish_reason"] == "stop")
    assert_user_error(run_nano("chat", "glm-5.2-random", "-p", "hello", "--max-tokens", "256", *small),
                      f"prompt ({reply['prompt_tokens']} tokens) + max_tokens (256) is more than the KV pool holds "
                      f"(64 tokens): use --max-tokens {room} or less or a bigger --kv-budget", exit_code=2)
