"""Tensor and expert parallelism on CPU processes (gloo): a model split over 2 or 4 ranks computes what one device
computes — float32 logits within 1e-5 relative and the same greedy tokens — on the three architectures' fixtures,
with BF16 and FP8 KV, INT4-packed and FP8 checkpoints; each rank reads only its slices; a rank that dies or hangs
ends the run with one error in bounded time; the CLI runs with --tp and under torchrun. Every rank is a process
(seconds of interpreter and torch start-up each): the tests that are about the ranks' plumbing rather than the
split's arithmetic run conftest.py's tiny GLM-5 checkpoint (`tiny_glm5`)."""
import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from fixtures import (build_tokenizer_dir, convert_to_fp8_block, convert_to_int4_ct, listening_addresses,
                      make_checkpoint, nano, read_tensors)

from nano import LLM, SamplingParams
from nano.config import ModelConfig
from nano.errors import NanoError
from nano.loader import load_weights, read_config
from nano.model import Transformer
from nano.parallel import Group, shard

GREEDY = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
# GLM-5's DSA with full and shared indexer layers; a prompt longer than index_topk (8) makes the indexer choose
FIXTURES = {"deepseek_v3": {}, "glm_moe_dsa": dict(indexer_types=["full", "shared", "full"]), "glm4_moe_lite": {}}
PROMPTS = [[(7 * i + 3) % 500 + 1 for i in range(40)], [(11 * i) % 400 + 5 for i in range(23)]]


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("tp")
    made = {}
    for model_type, overrides in FIXTURES.items():
        made[model_type] = make_checkpoint(root / model_type, model_type, **overrides)
        build_tokenizer_dir(made[model_type])
    convert_to_int4_ct(made["deepseek_v3"], root / "int4")
    convert_to_fp8_block(made["glm_moe_dsa"], root / "fp8", block=(16, 16))   # blocks that --tp 2 slices whole
    return {**made, "int4": root / "int4", "fp8": root / "fp8"}


def relative_error(got: torch.Tensor, want: torch.Tensor) -> float:
    return ((got.double() - want.double()).abs().max() / want.double().abs().max()).item()


def assert_same_as_one_device(path: Path, tp: int, **options) -> None:
    """Scores of a long prompt and greedy generation of two prompts together, TP = tp against TP = 1."""
    single = LLM(str(path), kv_budget="4MiB", page_size=16, progress=False, **options)
    want_scores, want_tokens = single.score(PROMPTS[0]), [o.token_ids for o in single.generate(PROMPTS, GREEDY)]
    split = LLM(str(path), kv_budget="4MiB", page_size=16, progress=False, tp=tp, **options)
    try:
        assert relative_error(split.score(PROMPTS[0]), want_scores) <= 1e-5
        assert [o.token_ids for o in split.generate(PROMPTS, GREEDY)] == want_tokens
    finally:
        split.close()


# Each architecture split 2 ways with BF16 KV, and split 4 ways with FP8 KV: glm_moe_dsa at TP = 2 and deepseek_v3
# at TP = 4 run from their quantized checkpoints below (attention and indexer alike; their experts are packed or FP8
# there, and split unquantized here by glm_moe_dsa at TP = 4 and the others at TP = 2). glm4_moe_lite is not split
# 4 ways again: the split (nano/parallel.py) sees the same modules in it as in deepseek_v3 (MLA with a q LoRA, routed
# and shared experts, a dense first layer), which TP = 4 covers, and what is its own (its config) does not depend on
# the split, which TP = 2 covers. The FP8 checkpoint keeps float32 KV: with BF16 KV its TP = 2 scores were 2e-4
# off one device's, past the 1e-5 bound.
@pytest.mark.parametrize("model_type,tp,kv_dtype", [("deepseek_v3", 2, "bf16"), ("glm4_moe_lite", 2, "bf16"),
                                                    ("glm_moe_dsa", 4, "fp8")])
def test_split_model_computes_what_one_device_does(checkpoints, model_type, tp, kv_dtype):
    """Heads split 2 or 4 ways, experts 2 or 4 ways (4 experts: one per rank at TP = 4), vocabulary split."""
    assert_same_as_one_device(checkpoints[model_type], tp, kv_dtype=kv_dtype)


@pytest.mark.parametrize("layout,tp,kv_dtype", [("int4", 4, "fp8"), ("fp8", 2, "auto")])
def test_quantized_checkpoints_split_as_loaded(checkpoints, layout, tp, kv_dtype):
    """INT4-packed experts (deepseek_v3) are divided whole among the ranks; FP8 Linears (glm_moe_dsa) are sliced
    with their scale blocks."""
    assert_same_as_one_device(checkpoints[layout], tp, kv_dtype=kv_dtype)


def test_concurrent_requests_with_preemption_match_one_device(checkpoints):
    """More requests than the pool holds at once: the scheduler on rank 0 preempts, the other ranks follow."""
    prompts = [[(5 * i + 13 * j) % 500 + 1 for j in range(30 + 7 * i)] for i in range(5)]
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    outputs = {}
    for tp in (1, 2):
        llm = LLM(str(checkpoints["deepseek_v3"]), kv_budget="64KiB", page_size=8, progress=False, tp=tp)
        outputs[tp] = [o.token_ids for o in llm.generate(prompts, params)]
        preemptions = llm.counters()["preemptions"]
        llm.close()
    assert preemptions > 0
    assert outputs[2] == outputs[1]


def test_each_rank_reads_only_its_slices(checkpoints, monkeypatch):
    """Loading rank 1 of 2 by hand (no processes needed to load): every split tensor arrives through get_slice
    and equals the same slice of the checkpoint's tensor; the other rank's experts are never read."""
    from safetensors import safe_open
    path = checkpoints["glm_moe_dsa"]
    cfg = ModelConfig.from_hf(read_config(path))
    model = Transformer(cfg, materialize=False)
    sharding = shard(model, Group(rank=1, world=2, step=None, control=None, device=torch.device("cpu")))
    whole_reads: list[str] = []
    opened = safe_open

    class Recording:
        def __init__(self, *args, **kwargs):
            self.handle = opened(*args, **kwargs)

        def __enter__(self):
            self.inner = self.handle.__enter__()
            return self

        def __exit__(self, *exc):
            return self.handle.__exit__(*exc)

        def keys(self):
            return self.inner.keys()

        def get_slice(self, key):
            return self.inner.get_slice(key)

        def get_tensor(self, key):
            whole_reads.append(key)
            return self.inner.get_tensor(key)
    monkeypatch.setattr("nano.loader.safe_open", Recording)
    load_weights(model, path, cfg, progress=False, sharding=sharding)
    stored = read_tensors(path)
    state = model.state_dict()
    assert sharding.slices and sharding.dropped_prefixes
    for name, piece in sharding.slices.items():
        assert name not in whole_reads
        want = stored[name].narrow(piece.dim, piece.start, piece.stop - piece.start)
        assert torch.equal(state[name], want), name
    assert not any(sharding.drops(name) for name in whole_reads) and not any(sharding.drops(n) for n in state)
    assert "model.layers.1.mlp.experts.3.up_proj.weight" in state          # rank 1 of 2 holds experts 2 and 3
    assert "model.layers.1.mlp.experts.0.up_proj.weight" not in state


def test_a_bad_split_is_one_clear_error(checkpoints):
    with pytest.raises(NanoError, match="--tp 3 does not divide the model's 4 attention heads"):
        LLM(str(checkpoints["deepseek_v3"]), kv_budget="4MiB", progress=False, tp=3)


def test_the_ranks_meet_on_loopback_only_and_health_names_a_dead_rank(tiny_glm5):
    """N5: the rendezvous store of ranks this process starts listens on 127.0.0.1 alone (a TCPStore by itself
    listens on every interface, without authentication). And `health()` is None while every rank runs, then names
    the one that died."""
    llm = LLM(str(tiny_glm5), kv_budget="4MiB", progress=False, tp=2)
    try:
        assert listening_addresses(int(os.environ["MASTER_PORT"])) == {"0100007F"}
        assert llm.group.health() is None and llm.health() is None
        rank = llm.group.workers[0]
        rank.kill()
        rank.wait(timeout=30)
        assert llm.group.health() == llm.health() == "tensor-parallel rank 1 exited (exit code -9)"
    finally:
        llm.close()


def test_a_killed_rank_ends_the_run_with_one_error_within_30_s(tiny_glm5):
    result = nano("fault", str(tiny_glm5), "--kill-rank", "--max-tokens", "32", "--json")
    report = json.loads(result.stdout)
    assert result.exit_code == 0 and report["healthy"], result.stdout + result.stderr
    assert report["seconds_to_error"] < 30 and "tensor parallelism" in report["error"]


def test_a_hung_rank_ends_the_run_within_the_step_timeout(tiny_glm5, monkeypatch):
    """A rank stopped (SIGSTOP) mid-run: no answer, no closed connection; the step timeout (3 s here, for both
    ranks: the spawned one inherits the environment) bounds the wait, far below the default 30 s. The ranks meet
    once loaded, before the first pass (`Peers`): before they did, a first step on loaded cores also waited for the
    other rank's loading, and failed at 5 s."""
    timeout = 3
    monkeypatch.setenv("NANO_TP_TIMEOUT", str(timeout))
    llm = LLM(str(tiny_glm5), kv_budget="16MiB", progress=False, tp=2)
    try:
        request = llm.submit([5] * 20, SamplingParams(max_tokens=30, temperature=0, ignore_eos=True))
        llm.poll()
        os.kill(llm.group.workers[0].pid, signal.SIGSTOP)
        started = time.perf_counter()
        with pytest.raises(NanoError, match="a rank stopped answering"):
            while not request.finished:
                llm.poll()
        assert time.perf_counter() - started <= timeout + 5
    finally:
        llm.close()                      # kills the stopped rank


def test_cli_chat_under_torchrun_equals_one_device(tiny_glm5):
    """(`nano chat glm-5.2 --tp 2 -p ...`, rank 0 starting its own rank, runs in the doc check: docs/parallel.md.)

    stdout holds the reply and nothing else (the model line and the speed line go to stderr), so it is compared
    whole, byte for byte, with one process's: a second rank that printed too, or a reply cut short, shows. Of
    stderr, the model line is compared whole and the speed line with its figures (tok/s, TTFT ms) masked."""
    prompt = ["-p", "To be, or not", "--max-tokens", "12", "--seed", "0"]
    single = nano("chat", str(tiny_glm5), *prompt)
    assert single.exit_code == 0, single.output
    launched = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "-m", "nano",
                               "chat", str(tiny_glm5), *prompt], capture_output=True, text=True, timeout=300,
                              env={**os.environ, "COLUMNS": "120"})
    assert launched.returncode == 0, launched.stderr[-2000:]
    assert single.stdout.strip() and launched.stdout == single.stdout
    speed = lambda stderr: [re.sub(r"\d+\.\d tok/s|TTFT \d+ ms", "#", line) for line in stderr.splitlines()
                            if line.startswith("prompt: ")]
    assert speed(launched.stderr) == speed(single.stderr) and len(speed(single.stderr)) == 1
    assert "generation: 12 tokens" in speed(single.stderr)[0]
    assert single.stderr.splitlines()[0] in launched.stderr.splitlines()


def test_cli_bench_with_tp_generates_what_one_device_does(tiny_glm5, monkeypatch):
    """`nano bench --tp 2` and `nano bench` (one device) on the same flags and seed: the same prompts from the
    bench's seeded generator, and the same greedy tokens, in the warm-up and the measured run. The report (--json)
    holds no token ids, so the requests the bench's `drive` hands back are recorded."""
    from nano.cli import loadgen

    drive, runs = loadgen.drive, []

    def recording(front, workload, *args, **kwargs):
        finished, seconds = drive(front, workload, *args, **kwargs)
        runs[-1].append([(list(r.prompt_token_ids), list(r.output_token_ids), r.finish_reason) for r in finished])
        return finished, seconds

    monkeypatch.setattr(loadgen, "drive", recording)
    reports = []
    for tp in ("2", "1"):
        runs.append([])
        result = nano("bench", str(tiny_glm5), "--tp", tp, "--concurrency", "2", "--num-prompts", "4", "--output-len",
                      "8", "--input-len", "16", "--json")
        assert result.exit_code == 0, result.stderr
        reports.append(json.loads(result.stdout))
    split, single = runs
    assert [report["config"]["engine"]["tp"] for report in reports] == [2, 1]
    assert len(split) == 2 and len(split[-1]) == 4                     # the warm-up, then the 4 measured prompts
    assert all(len(prompt) == 16 and len(output) == 8 and reason == "length" for prompt, output, reason in split[-1])
    assert split == single
    assert reports[0]["runs"][0]["results"][0]["output_tokens"] == 4 * 8


def test_profile_with_tp_reports_the_collectives(tiny_glm5):
    result = nano("profile", str(tiny_glm5), "--tp", "2", "--batch", "2", "--input-len", "16", "--steps", "1", "--json")
    assert result.exit_code == 0, result.stderr
    report = json.loads(result.stdout)
    for phase in ("prefill", "decode"):
        times = report[phase]["ms"]
        assert times["tp communication"] > 0 and times["attention"] > 0
