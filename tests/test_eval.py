"""nano eval against independent computations: transformers' logits for bits per byte and top-1 accuracy, the
text's own UTF-8 length for the byte count, KL recomputed in float64 from nano's logits; the bootstrap and its
verdicts on constructions whose answer is known; the command line's outputs and its refusals."""
from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from fixtures import assert_user_error, build_tokenizer_dir, make_checkpoint, nano
from tokenizers import Tokenizer

from nano import LLM
from nano.evaluate import MAX_TOKENS, Bootstrap, ratio, read_text, tokenize

# characters the fixture tokenizer never saw: byte-level BPE splits each into single-byte tokens, so many tokens of
# this text hold part of a character
UNSEEN = " 日本語のテキスト, Ελληνικά ℵ₀ ∑ 🎉🎊 ǅ"
SMALL = 8                       # the small context: many windows, boundaries inside characters
LONG_WINDOWS = 2                # the long context: the text in two windows
RUN = ("--prompts", "4", "--prompt-tokens", "16", "--gen-tokens", "16", "--kv-budget", "4MiB")


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory) -> Path:
    path = make_checkpoint(tmp_path_factory.mktemp("eval") / "ckpt", "deepseek_v3", seed=2)
    return build_tokenizer_dir(path)


@pytest.fixture(scope="module")
def hf(ckpt):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(ckpt, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def text(ckpt, hf) -> tuple[Path, list[int]]:
    """A text file and its token ids: the model's own greedy continuation of 'hello' (among the tokens that are
    printable ASCII, so that top-1 accuracy is not 0 on a random model), then UNSEEN, then dots until the token
    count n has n - 1 divisible by SMALL * LONG_WINDOWS (so that the windows of both contexts cover every token
    but the first)."""
    tokenizer = Tokenizer.from_file(str(ckpt / "tokenizer.json"))
    printable = torch.tensor([i < tokenizer.get_vocab_size() and tokenizer.decode([i]).strip().isascii()
                              and tokenizer.decode([i]).isprintable() and tokenizer.decode([i]).strip() != ""
                              for i in range(hf.config.vocab_size)])
    ids = tokenizer.encode("hello").ids
    with torch.no_grad():
        for _ in range(150):
            logits = hf(torch.tensor([ids[-24:]])).logits[0, -1]
            ids.append(int(logits.masked_fill(~printable, -math.inf).argmax()))
    content = tokenizer.decode(ids) + UNSEEN
    while len(tokenizer.encode(content).ids) % (SMALL * LONG_WINDOWS) != 1:
        content += "."
    ids = tokenizer.encode(content).ids
    assert len(ids) < hf.config.max_position_embeddings
    path = ckpt.parent / "heldout.txt"
    path.write_text(content)
    return path, ids


@pytest.fixture(scope="module")
def report(ckpt, text) -> dict:
    """`nano eval --json` at both contexts: fp32 pages (the reference's own) and FP8 pages."""
    path, ids = text
    result = nano("eval", str(ckpt), "--text", str(path), "--context", f"{SMALL},{long_context(ids)}",
                  "--compare", "kv-dtype=fp32,fp8", *RUN, "--json")
    assert result.exit_code == 0, result.output
    return json.loads(result.stdout)


def long_context(ids: list[int]) -> int:
    return (len(ids) - 1) // LONG_WINDOWS


def windows(ids: list[int], context: int) -> list[tuple[list[int], list[int]]]:
    """Non-overlapping windows of `context` tokens and the tokens they predict."""
    return [(ids[s:s + context], ids[s + 1:s + context + 1]) for s in range(0, len(ids) - context, context)]


# ---- bytes ---------------------------------------------------------------------------------------------------------
def test_bytes_are_exact_where_tokens_split_characters(ckpt, text, report):
    path, ids = text
    tokenizer = Tokenizer.from_file(str(ckpt / "tokenizer.json"))
    content = path.read_text()
    assert any("\ufffd" in tokenizer.decode([i]) for i in ids)   # decoding tokens alone would miscount
    first = len(tokenizer.decode(ids[:1]).encode())             # the text's first token: "hello", never predicted
    for figures in report["contexts"]:
        assert figures["tokens"] == len(ids) - 1
        assert figures["bytes"] == len(content.encode("utf-8")) - first
    llm = LLM(str(ckpt), kv_budget="4MiB", progress=False)
    got_ids, nbytes, size = tokenize(read_text(path), llm.tokenizer, len(ids))
    assert got_ids == ids and sum(nbytes) == len(content.encode("utf-8")) == size
    assert b"".join(llm.tokenizer.token_bytes()[i] for i in ids[:3]) == content.encode()[:sum(nbytes[:3])]


# ---- the figures against transformers and against nano's own logits ---------------------------------------------
def test_bits_per_byte_and_top1_match_transformers(ckpt, hf, text, report):
    path, ids = text
    first = Tokenizer.from_file(str(ckpt / "tokenizer.json")).decode(ids[:1])
    assert first.isascii()
    nbytes = len(path.read_text().encode()) - len(first)
    for context_figures, context in zip(report["reference"]["contexts"], (SMALL, long_context(ids))):
        nats, right, count = 0.0, 0, 0
        with torch.no_grad():
            for inputs, targets in windows(ids, context):
                logits = hf(torch.tensor([inputs])).logits[0].double()                     # [C, vocab]
                nats += torch.nn.functional.cross_entropy(logits, torch.tensor(targets), reduction="sum").item()
                right += int((logits.argmax(-1) == torch.tensor(targets)).sum())
                count += len(targets)
        assert context_figures["bits_per_byte"]["value"] == pytest.approx(nats / math.log(2) / nbytes, rel=1e-5)
        assert abs(context_figures["top1_accuracy"]["value"] * count - right) <= 1   # a near-tie may flip
        assert right > 0


def test_kl_and_agreement_against_float64_from_nanos_logits(ckpt, text, report):
    path, ids = text
    runs = {kv: LLM(str(ckpt), kv_dtype=kv, kv_budget="4MiB", progress=False) for kv in ("fp32", "fp8")}
    configurations = {c["name"]: c for c in report["configurations"]}
    for i, context in enumerate((SMALL, long_context(ids))):
        kl, agree = [], []
        for inputs, _ in windows(ids, context):
            reference, fp8 = (runs[kv].score(inputs).double().log_softmax(-1) for kv in ("fp32", "fp8"))
            kl.append((reference.exp() * (reference - fp8)).sum(-1))
            agree.append(reference.argmax(-1) == fp8.argmax(-1))
        kl, agree = torch.cat(kl), torch.cat(agree)
        figures = configurations["kv-dtype=fp8"]["contexts"][i]
        assert figures["kl_mean"]["value"] == pytest.approx(kl.mean().item(), rel=1e-6)
        assert figures["kl_p99"]["value"] == pytest.approx(torch.quantile(kl, 0.99).item(), rel=1e-6)
        assert figures["top1_agreement"]["value"] == pytest.approx(agree.double().mean().item())
        assert kl.mean() > 0
        same = configurations["kv-dtype=fp32"]["contexts"][i]   # the reference's own configuration
        assert same["kl_mean"]["value"] == same["kl_p99"]["value"] == 0 and same["top1_agreement"]["value"] == 1
        assert same["delta_bits_per_byte"]["verdict"] == same["delta_top1_accuracy"]["verdict"] == "within noise"


def test_generation_agreement_counts_tokens_until_the_first_difference(ckpt, text, report):
    from nano import SamplingParams

    _, ids = text
    span = len(ids) - 16
    prompts = [ids[i * span // 4:i * span // 4 + 16] for i in range(4)]      # spread evenly, as documented
    greedy = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    outs = {kv: [o.token_ids for o in LLM(str(ckpt), kv_dtype=kv, kv_budget="4MiB", progress=False)
                 .generate(prompts, greedy)] for kv in ("fp32", "fp8")}
    want = []
    for ours, theirs in zip(outs["fp8"], outs["fp32"]):
        same = [a == b for a, b in zip(ours, theirs)] + [False]
        want.append(same.index(False))
    configurations = {c["name"]: c["generation"] for c in report["configurations"]}
    assert configurations["kv-dtype=fp8"]["matched"] == want
    assert configurations["kv-dtype=fp32"]["matched"] == [16] * 4 and configurations["kv-dtype=fp32"]["identical"] == 4


# ---- the bootstrap -------------------------------------------------------------------------------------------------
def estimates(node, key: str = ""):
    """Every (name, {value, low, high, ...}) in a report."""
    if isinstance(node, dict):
        if {"value", "low", "high"} <= set(node):
            yield key, node
        for name, child in node.items():
            yield from estimates(child, name)
    elif isinstance(node, list):
        for child in node:
            yield from estimates(child, key)


def test_every_interval_holds_its_estimate(report):
    # quantiles (KL p99, the median continuation) are left out: a percentile interval need not hold a quantile
    found = [e for name, e in estimates(report) if name not in ("kl_p99", "median")]
    assert len(found) >= 20
    for estimate in found:
        assert estimate["low"] - 1e-12 <= estimate["value"] <= estimate["high"] + 1e-12


def test_intervals_narrow_with_more_windows():
    generator = torch.Generator().manual_seed(0)
    nats = torch.rand(256, generator=generator, dtype=torch.float64) * 100        # per window
    nbytes = torch.full((256,), 50.0, dtype=torch.float64)
    width = lambda n: (lambda e: e.high - e.low)(Bootstrap(n, 1000, 0).estimate(ratio(nats[:n], nbytes[:n])))
    assert width(256) < width(64) < width(16) and width(256) < 0.5 * width(16)    # about 1 / sqrt(windows)


def test_paired_verdicts_come_out_worse_better_or_within_noise():
    generator = torch.Generator().manual_seed(1)
    nbytes = torch.randint(20, 80, (40,), generator=generator).double()          # per window
    reference = nbytes * (1 + torch.rand(40, generator=generator, dtype=torch.float64))   # nats, 1-2 per byte
    boot, bits = Bootstrap(40, 1000, 0), lambda nats: ratio(nats, nbytes, 1 / math.log(2))
    # every window 1% worse: a shift far smaller than the spread between windows, found because it is paired
    worse = boot.delta(bits(reference * 1.01), bits(reference), lower_is_better=True)
    assert worse.verdict == "worse" and worse.low > 0
    assert boot.delta(bits(reference * 0.99), bits(reference), lower_is_better=True).verdict == "better"
    # unpaired, the same 1% disappears in the spread between windows
    unpaired = boot.estimate(bits(reference * 1.01))
    assert unpaired.low < boot.estimate(bits(reference)).value
    # the windows' losses swapped in pairs: the same total, with resamples on either side of it
    swapped = reference.view(20, 2).flip(1).flatten()
    noise = boot.delta(bits(swapped), bits(reference), lower_is_better=True)
    assert noise.verdict == "within noise" and noise.low < 0 < noise.high
    accuracy = boot.delta(ratio(torch.full((40,), 9.0), torch.full((40,), 10.0)),
                          ratio(torch.full((40,), 8.0), torch.full((40,), 10.0)), lower_is_better=False)
    assert accuracy.verdict == "better"


# ---- the command line -----------------------------------------------------------------------------------------------
def test_table_and_output_file(ckpt, text, tmp_path):
    path, ids = text
    result = nano("eval", str(ckpt), "--text", str(path), "--context", f"{SMALL},{long_context(ids)}", "--compare",
                  "policy=bf16/int4", "--output", str(tmp_path / "eval.json"), "--plot", str(tmp_path / "eval.svg"),
                  *RUN)
    assert result.exit_code == 0, result.output
    printed = " ".join(result.stdout.split())
    for words in ("bits per byte", "reference", "policy=bf16/int4", "KL mean", "top-1 agreement", "verdict",
                  "within noise", "identical throughout", "Measured here on", "run the prefill weights"):
        assert words in printed
    assert f"warning: --context {long_context(ids)}: {LONG_WINDOWS} windows" in result.stderr
    written = json.loads((tmp_path / "eval.json").read_text())
    assert written["label"] and written["text"]["path"] == str(path)
    assert [c["setup"]["decode_weights"] for c in written["configurations"]] == ["int4"]
    chart = (tmp_path / "eval.svg").read_text()     # its series, one per configuration (tests/test_plot.py)
    assert 'id="delta/policy-bf16-int4"' in chart and 'id="kl/policy-bf16-int4"' in chart
    assert f"{long_context(ids):,}" in chart and written["label"] in chart
    # the model line goes to stderr (docs/cli.md), with the plan: per configuration, both contexts' windows cover
    # every token but the first, then 4 prompts of 16 tokens and 16 generated each
    assert written["label"] in result.stderr.splitlines() and written["label"] not in result.stdout
    tokens = 2 * (len(ids) - 1) + 4 * (16 + 16)
    assert f"plan: 2 phases: reference ({tokens:,} tokens); policy=bf16/int4 ({tokens:,} tokens)." in result.stderr


def test_the_model_alone_gets_its_own_figures_and_a_hint(ckpt, text, report, tmp_path):
    """Without --compare and with no flag that changes the model, there is nothing to compare with: one column of
    its own figures with intervals (the reference's, as a comparison measures them), no Δ, and a hint."""
    path, ids = text
    flags = ("--text", str(path), "--context", f"{SMALL},{long_context(ids)}", *RUN)
    result = nano("eval", str(ckpt), *flags)
    assert result.exit_code == 0, result.output
    lines = result.stdout.splitlines()
    assert not any(word in result.stdout for word in ("Δ", "KL", "agreement", "greedy continuations", "verdict"))
    header = next(line for line in lines if line.strip().startswith("reference"))
    assert header.split() == ["reference"]                                    # one column
    for context in report["reference"]["contexts"]:
        figures = context["bits_per_byte"]
        row = f"{figures['value']:.4f}"
        assert any(line.split()[-1] == row for line in lines if line.startswith(" bits per byte")), row
        assert f"[{figures['low']:.4f}, {figures['high']:.4f}]" in result.stdout
    assert "--compare kv-dtype=bf16,fp8" in result.stderr and result.stderr.count("plan: 1 phase: reference") == 1
    alone = json.loads(nano("eval", str(ckpt), *flags, "--json").stdout)
    assert alone["configurations"] == [] and alone["reference"] == report["reference"]
    # nothing to draw against the reference: refused before anything runs (no plan, no file)
    refused = nano("eval", str(ckpt), *flags, "--kv-dtype", "auto", "--plot", str(tmp_path / "alone.svg"))
    assert_user_error(refused, "draws configurations against the reference", exit_code=2)
    assert "plan:" not in refused.stderr and not (tmp_path / "alone.svg").exists()


def test_report_says_what_ran(ckpt, text, report):
    path, ids = text
    assert report["model"] == str(ckpt) and str(ckpt) in report["label"]
    assert report["text"] == {"path": str(path), "bytes": len(path.read_text().encode()), "tokens": len(ids),
                              "evaluated_tokens": len(ids)}
    assert [c["context"] for c in report["contexts"]] == [SMALL, long_context(ids)]
    assert report["reference"]["setup"] == {"prefill_weights": "bf16", "decode_weights": "bf16", "kv_dtype": "fp32",
                                            "dtype": "float32", "matmuls": "float32"}
    assert [c["setup"]["kv_dtype"] for c in report["configurations"]] == ["fp32", "fp8:token"]
    assert report["measured_on"] and report["settings"]["resamples"] == 1000


@pytest.mark.parametrize("args,fragment,code", [
    (("--compare", "speed=1,2"), "--compare takes KEY=A,B", 2),
    (("--compare", "kv-dtype="), "--compare takes KEY=A,B", 2),
    (("--compare", "weights=bf16,,int4"), "empty or listed twice", 2),
    (("--compare", "kv-dtype=fp4"), "kv-dtype= takes", 2),
    (("--compare", "policy=int4"), "PREFILL/DECODE", 2),
    (("--compare", "kv-dtype=bf16,fp8", "--kv-dtype", "fp8"), "--kv-dtype does nothing", 2),
    (("--context", "8,abc"), "--context takes window sizes", 2),
    (("--context", "1"), "at least 2 tokens", 2),
    (("--context", "8,8"), "listed twice", 2),
    (("--context", "256"), "more than the model scores at once", 1),
    (("--prompts", "0"), "--prompts", 2),
    (("--prompts", "1"), "--prompts", 2),
    (("--prompts", "200"), "different prompts of 64 tokens, fewer than the 200 asked for", 1),   # repeats: no use
    (("--max-tokens", str(MAX_TOKENS + 1)), "--max-tokens", 2),
    (("--prompt-tokens", "200", "--gen-tokens", "100"), "more than the model's context", 1),
    (("--text", "/nonexistent/text.txt"), "--text /nonexistent/text.txt: No such file", 1),
    (("--text", "/"), "--text / is not a regular file", 1),
    (("--output", "/nonexistent/dir/eval.json"), "does not exist", 1),
    (("--disagg",), "No such option", 2),
])
def test_bad_input_is_one_line(ckpt, text, args, fragment, code):
    path, _ = text
    given = ("--text", str(path)) if "--text" not in args else ()
    given += ("--context", str(SMALL)) if "--context" not in args else ()
    assert_user_error(nano("eval", str(ckpt), *given, *args), fragment, code)


def test_texts_that_cannot_be_evaluated(ckpt, tmp_path, monkeypatch):
    short = tmp_path / "short.txt"
    short.write_text("hello world")
    assert_user_error(nano("eval", str(ckpt), "--text", str(short), "--context", "64", *RUN),
                      "too few for two windows of 64 tokens", 1)
    latin1 = tmp_path / "latin1.txt"
    latin1.write_bytes("café".encode("latin-1"))
    assert_user_error(nano("eval", str(ckpt), "--text", str(latin1)), "is not UTF-8 text", 1)
    monkeypatch.setattr("nano.evaluate.HELDOUT_TEXT", tmp_path / "missing" / "heldout.txt")
    assert_user_error(nano("eval", str(ckpt)), "give one with --text FILE", 1)


# ---- reading only what is used ----------------------------------------------------------------------------------
def test_junk_past_the_used_tokens_changes_no_figure(ckpt, text, report, tmp_path):
    """The same text with a long tail that ends in a byte that is not UTF-8 (read, it would be refused), evaluated
    only as far as the text: every figure is the text's own."""
    path, ids = text
    tail = "\n" + "\0" * 2**20
    assert Tokenizer.from_file(str(ckpt / "tokenizer.json")).encode(path.read_text() + tail).ids[:len(ids)] == ids
    junk = tmp_path / "junk.txt"
    junk.write_bytes((path.read_text() + tail).encode() + b"\xff")
    result = nano("eval", str(ckpt), "--text", str(junk), "--context", f"{SMALL},{long_context(ids)}",
                  "--compare", "kv-dtype=fp32,fp8", *RUN, "--max-tokens", str(len(ids) - 1), "--json")
    assert result.exit_code == 0, result.output
    tailed = json.loads(result.stdout)
    for key in ("contexts", "reference", "configurations"):
        assert tailed[key] == report[key]
    assert tailed["text"] == {"path": str(junk), "bytes": junk.stat().st_size, "tokens": None,
                              "evaluated_tokens": len(ids)}


def test_a_huge_sparse_file_is_read_only_as_far_as_used(ckpt, text, tmp_path):
    path, _ = text
    huge = tmp_path / "huge.txt"
    with huge.open("wb") as file:
        file.write(path.read_bytes())
        file.truncate(2**31)             # 2 GiB: NUL bytes past the text, that take no disk
    result = nano("eval", str(ckpt), "--text", str(huge), "--context", str(SMALL), "--max-tokens", "256", *RUN)
    assert result.exit_code == 0, result.output
    printed = " ".join(result.stdout.split())
    assert f"text: {huge} · {2**31:,} bytes · read only as far as used: 257 tokens evaluated" in printed


@pytest.mark.parametrize("kind", ["fifo", "device"])
def test_a_fifo_or_a_device_is_refused_without_reading(ckpt, tmp_path, kind):
    """In a child process with a time limit, so that a FIFO opened for reading (which waits for a writer) or
    /dev/zero read to its end (which has none) fails the test instead of hanging it."""
    given = Path("/dev/zero")
    if kind == "fifo":
        given = tmp_path / "text.fifo"
        os.mkfifo(given)
    done = subprocess.run([sys.executable, "-m", "nano", "eval", str(ckpt), "--text", str(given), "--context", "8"],
                          capture_output=True, text=True, timeout=300, env={**os.environ, "COLUMNS": "200"})
    assert done.returncode == 1, done.stderr
    assert done.stderr.strip().splitlines() == [f"error: --text {given} is not a regular file (a FIFO, a device or "
                                                f"a directory is refused)"]
