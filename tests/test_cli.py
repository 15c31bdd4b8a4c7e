"""The `nano` command line, end to end on the nano stand-ins (about 1 s to load, a few ms per token).

The quick-start command and every command's --help run in real subprocesses, through both entry points: the
`nano` console script and `python -m nano`. Everything else goes through Typer's CliRunner (`fixtures.nano`).
Every bad input must end in one `error:` line and a non-zero exit, never a traceback.
"""
from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import typer
from typer.testing import CliRunner

from fixtures import assert_user_error, nano
from nano.cli.chat import terminal_safe
from nano.cli.options import DEFAULTS, FLAGS, EngineOptions, engine_flags
from nano.config import ModelConfig
from nano.engine import EngineConfig
from nano.llm import LLM
from nano.presets import PRESETS
from nano.sampling import SamplingParams

REPO_ROOT = Path(__file__).resolve().parent.parent
COMMANDS = ("models", "chat", "bench", "profile", "fault", "eval")


def console_script() -> list[str]:
    """The installed `nano` script beside this Python (not whatever `nano` comes first on PATH: maybe the editor)."""
    script = shutil.which("nano", path=str(Path(sys.executable).parent))
    if script is None:
        pytest.skip("the nano console script is not installed beside this Python (pip install -e .)")
    return [script]


ENTRY_POINTS = {"console script": console_script, "python -m nano": lambda: [sys.executable, "-m", "nano"]}


def run(entry_point: str, *args: str, cwd: Path, timeout: int = 60) -> subprocess.CompletedProcess:
    return subprocess.run([*ENTRY_POINTS[entry_point](), *args], cwd=cwd, capture_output=True, text=True,
                          timeout=timeout, env={**os.environ, "COLUMNS": "200"})


# ---- the entry points, as a user runs them ---------------------------------------------------------------------
@pytest.mark.parametrize("preset, label_start", [
    ("glm-5.2", "trained nano stand-in of glm-5.2, "), ("kimi-k2.6", "trained nano stand-in of kimi-k2.6, "),
    ("glm-5.2-random", "nano glm-5.2-random (random weights, same architecture as zai-org/GLM-5.2)"),
    ("moonlight-16b", "nano moonlight-16b (random weights, same architecture as moonshotai/Moonlight-16B")])
def test_quick_start_one_shot_chat(preset, label_start):
    """The quick start's glm-5.2 runs through the installed console script, a real process as a user starts it; the
    other presets run the same command in process (what differs between them is the model, not the entry point,
    and each process costs seconds of interpreter and torch start-up)."""
    args = ("chat", preset, "-p", "hi", "--max-tokens", "8")
    if preset == "glm-5.2":
        done = run("console script", *args, cwd=REPO_ROOT, timeout=120)
        exit_code, stdout, stderr = done.returncode, done.stdout, done.stderr
    else:
        result = nano(*args)
        exit_code, stdout, stderr = result.exit_code, result.stdout, result.stderr
    assert exit_code == 0, stderr
    label = stderr.splitlines()[0]                                # says plainly what is running, on one line
    assert label.startswith(label_start)
    assert stdout.strip(), "no generated text on stdout"
    assert "generation:" in stderr and "tok/s" in stderr
    if preset in ("glm-5.2", "kimi-k2.6"):   # trained on Shakespeare: only a special token could show these
        assert "<|" not in stdout and "[EOS]" not in stdout, stdout


@pytest.mark.parametrize("entry_point", ENTRY_POINTS)
def test_no_command_lists_every_command(entry_point, tmp_path):
    done = run(entry_point, cwd=tmp_path)             # outside the repository: the installed package, not ./cli
    assert done.returncode == 0, done.stderr
    commands = done.stdout.partition("\nCommands:\n")[2]             # Click's plain help: one command per line
    listed = {line.split()[0] for line in commands.splitlines() if line.startswith("  ") and line[2] != " "}
    assert set(COMMANDS) <= listed, done.stdout + done.stderr


@pytest.mark.parametrize("command", COMMANDS)
@pytest.mark.parametrize("entry_point", ENTRY_POINTS)
def test_every_command_help_through_both_entry_points(entry_point, command, tmp_path):
    """`nano COMMAND --help` works through both entry points and lists every one of the command's options."""
    from nano.cli.main import app

    click_command = typer.main.get_group(app).commands[command]
    expected = {option for param in click_command.params for option in (*param.opts, *param.secondary_opts)
                if option.startswith("--")}
    done = run(entry_point, command, "--help", cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    assert f"Usage: nano {command}" in done.stdout
    shown = set(re.findall(r"--[a-z0-9-]+", done.stdout))
    assert expected <= shown, sorted(expected - shown)
    assert "--help" in shown and "-h" in done.stdout


def test_pyproject_installs_every_package_and_the_cli_as_nano_cli():
    """The package list is explicit (nano.cli comes from the cli/ folder, not from nano/cli/): every package
    under nano/ must be in it, or a wheel would ship without it."""
    tomllib = pytest.importorskip("tomllib")
    setuptools = tomllib.loads((REPO_ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    under_nano = {".".join(init.parent.relative_to(REPO_ROOT).parts)
                  for init in (REPO_ROOT / "nano").rglob("__init__.py")}
    assert set(setuptools["packages"]) == under_nano | {"nano.cli"}
    assert setuptools["package-dir"] == {"nano.cli": "cli"}


def test_cli_imports_point_one_way():
    """main imports the command modules; nothing imports main; only bench imports blog; the load generator
    under bench and blog imports neither (tests/test_layout.py checks the whole tree for cycles)."""
    import ast

    imports = {}
    for path in (REPO_ROOT / "cli").glob("*.py"):
        found = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and (node.level or (node.module or "").startswith("nano.cli")):
                module = (node.module or "").removeprefix("nano.cli").strip(".")
                found |= {module} if module else {alias.name for alias in node.names}
            elif isinstance(node, ast.Import):
                found |= {alias.name.removeprefix("nano.cli.") for alias in node.names
                          if alias.name.startswith(("cli", "nano.cli."))}
        imports[path.stem] = found
    assert imports["main"] >= set(COMMANDS)
    assert not [name for name, found in imports.items() if "main" in found]
    assert [name for name, found in imports.items() if "blog" in found] == ["bench"]
    assert not imports["loadgen"] & {"bench", "blog", *COMMANDS}
    assert not any(found & set(COMMANDS) for name, found in imports.items() if name != "main")
    assert not (REPO_ROOT / "cli" / "app.py").exists()


def test_engine_flags_are_declared_once():
    """chat and bench offer every engine flag, profile all but the pool and split ones, with EngineOptions'
    defaults; the decorated command receives them as one EngineOptions."""
    from nano.cli.main import app

    commands = typer.main.get_group(app).commands
    flag_names = lambda name: {param.name for param in commands[name].params} & set(FLAGS)
    assert flag_names("chat") == flag_names("bench") == set(FLAGS)
    assert flag_names("profile") == set(FLAGS) - {"kv_budget", "max_running", "disagg", "prefill_kv_dtype",
                                                  "decode_kv_dtype", "transport"}
    assert flag_names("fault") == {"dtype", "kv_dtype", "page_size", "integrity", "prefix_cache", "threads"}
    for param in commands["bench"].params:
        if param.name in FLAGS:
            assert param.default == DEFAULTS[param.name], param.name

    received = []
    probe = typer.Typer()

    @probe.command()
    @engine_flags(skip=("transport",))
    def command(count: int = 1, *, engine: EngineOptions) -> None:
        received.append((count, engine))

    result = CliRunner().invoke(probe, ["--count", "3", "--kv-dtype", "fp8", "--dtype", "bfloat16",
                                        "--no-integrity"])
    assert result.exit_code == 0, result.output
    expected = EngineOptions(EngineConfig(kv_dtype="fp8", dtype="bfloat16", integrity=False),
                             typed=frozenset({"kv_dtype", "dtype", "integrity"}))
    assert received == [(3, expected)]
    assert CliRunner().invoke(probe, ["--transport", "gloo"]).exit_code == 2      # skipped: not an option


# ---- nano models ---------------------------------------------------------------------------------------------
def test_models_table_shows_kv_bytes_per_token():
    result = nano("models")
    assert result.exit_code == 0, result.output
    lines = result.stdout.splitlines()

    def first_row(label: str) -> list[str]:   # the published model's row (the stand-in's rows come later)
        return next(line for line in lines if line.strip().startswith(label)).split()[len(label.split()):]

    header = next(line for line in lines if "kimi-k2.6" in line)
    assert header.split()[:2] == ["kimi-k2.6", "glm-5.2"]                 # one column per preset
    assert first_row("KV B/token BF16")[:2] == ["70,272", "95,232"]
    assert first_row("KV B/token FP8")[:2] == ["35,136", "47,700"]
    assert first_row("attention")[:2] == ["MLA", "MLA+DSA"]
    assert first_row("runs here")[:4] == ["trained", "stand-in", "trained", "stand-in"]   # no checkpoint here
    assert "trained stand-in" in result.stdout and "<preset>-random" in result.stdout


def test_models_json():
    result = nano("models", "--json")
    assert result.exit_code == 0, result.output
    rows = {row["name"]: row for row in json.loads(result.stdout)}
    assert set(rows) >= {"kimi-k2.6", "glm-5.2"}
    kimi = rows["kimi-k2.6"]
    assert kimi["kv_bytes_per_token"] == {"bf16": 70_272, "fp8": 35_136}
    assert (kimi["layers"], kimi["routed_experts"], kimi["experts_per_token"]) == (61, 384, 8)
    assert kimi["attention"] == "MLA" and rows["glm-5.2"]["attention"] == "MLA+DSA"
    assert kimi["params_active"] < kimi["params_total"]
    assert rows["glm-5.2"]["runs_here"] == "trained stand-in"
    assert rows["glm-4.7-flash"]["runs_here"] == "random stand-in"
    trained = kimi["trained_stand_in"]
    assert trained["params_total"] == 10_521_600 and trained["params_active"] < trained["params_total"]
    assert rows["glm-4.7-flash"]["trained_stand_in"] is None


def test_models_capacity_table():
    result = nano("models", "--capacity")
    assert result.exit_code == 0, result.output

    def row(checkpoint: str, layout: str) -> list[str]:
        line = next(line for line in result.stdout.splitlines() if line.split()[:2] == checkpoint.split()
                    and layout in line)
        return line.split(layout)[1].split()

    assert row("kimi-k2.6 INT4", "BF16") == ["70,272", "686K", "686K", "fitted"]   # the budget is solved from it
    assert row("kimi-k2.6 INT4", "FP8, tensor scale") == ["35,136", "1.37M", "1.37M", "-0.0%"]
    assert row("kimi-k2.6 INT4", "FP8, token scale (nano)") == ["35,380", "1.36M"]
    assert row("glm-5.2 INT4", "FP8 + indexer, 79 layers") == ["55,932", "1.18M", "1.18M", "+0.2%"]
    assert "143,771 MiB = 140.4 GiB" in result.stdout and "114.07 GiB" in result.stdout
    text = " ".join(result.stdout.split())          # wrapped prose as one line
    assert "fitted: solved from Kimi K2.6's published 686k BF16 tokens" in text
    assert "not an independent derivation" in text
    # the prose's numbers, from the published architectures: a 512 latent + 64 rope values and a 4 B fp32 scale
    # per token per layer; GLM-5.2's indexer on 21 of its 78 layers, plus one MTP layer
    assert "2.000×" in text and "1.986×" in text and "(576 + 4 B)" in text
    assert "its 21 full layers" in text and "its 1 MTP layer" in text


def test_models_capacity_json():
    result = nano("models", "--capacity", "--json")
    assert result.exit_code == 0, result.output
    data = json.loads(result.stdout)
    assert data["inputs"]["gpu_memory_mib"] == 143_771 and data["inputs"]["tensor_parallel"] == 8
    sizes = {(c["model"], c["weights"]): c for c in data["checkpoints"]}
    assert sizes["kimi-k2.6", "INT4"]["weights_per_gpu_gib"] == pytest.approx(69.2, abs=0.05)
    assert "fitted" in data["inputs"]["budget_source"]
    roles = [(row["model"], row["kv_dtype"], row["kv_layout"], row["role"]) for row in data["scenarios"]]
    assert [role for role in roles if role[3] == "fitted"] == [("kimi-k2.6", "bf16", None, "fitted")]
    for row in data["scenarios"]:     # what the fitted budget predicts for the other published figures
        if row["role"] == "compared":
            assert row["kv_layout"] == "tensor"      # the published FP8 arithmetic: 1 byte a value, no scale
            assert row["tokens"] == pytest.approx(row["published_tokens"], rel=0.01), row
    assert data["layout"] == {"kimi_values_per_token_layer": 512 + 64, "fp8_scale_bytes": 4,
                              "fp8_tile_bytes": {"latent": 512, "scales": 16, "rope": 128},
                              "glm_indexer_layers": 21, "glm_mtp_layers": 1}
    assert data["fp8_over_bf16_tokens"] == pytest.approx({"tensor": 2.0, "token": 1152 / 580, "tile": 1152 / 656},
                                                         abs=1e-4)


# ---- nano chat -p --------------------------------------------------------------------------------------------
def chat_json(*args: str, model: str = "glm-5.2-random") -> dict:
    result = nano("chat", model, "-p", "hello", "--json", *args)
    assert result.exit_code == 0, result.output
    return json.loads(result.stdout)


def test_json_reply_is_consistent():
    reply = chat_json("--max-tokens", "8", "--seed", "1")
    assert set(reply) >= {"model", "label", "prompt_tokens", "completion_tokens", "text", "token_ids",
                          "finish_reason", "timings"}
    assert reply["model"] == "glm-5.2-random" and "random weights" in reply["label"]
    assert reply["completion_tokens"] == len(reply["token_ids"]) <= 8
    assert reply["prompt_tokens"] > len("hello")                 # the chat template wraps the message
    assert reply["finish_reason"] in ("stop", "length")
    if reply["finish_reason"] == "length":
        assert reply["completion_tokens"] == 8
    assert reply["timings"]["total_s"] > 0


def test_seed_makes_replies_repeatable(tiny_glm5):
    """(On conftest.py's tiny checkpoint, as the other tests here that hold for any model: its steps cost a seventh
    of the stand-in's.)"""
    first, again = (chat_json("--seed", "7", "--max-tokens", "12", model=str(tiny_glm5)) for _ in range(2))
    assert first["token_ids"] == again["token_ids"]


def test_replies_without_a_seed_differ_from_run_to_run():
    """Without --seed each reply draws with a fresh seed, so two runs of the same session differ (they were the same,
    byte for byte: the seed came from the engine's 0 and the request's number). Each run answers "hello" three
    times; measured here, the random stand-in's first token after "hello" has a largest probability of 0.016 at
    the default temperature 0.7 and two draws agree with probability 0.0055, so three equal pairs of replies would
    be a chance of about 2e-7 (less still for their 12 tokens)."""
    session = "hello\n/reset\nhello\n/reset\nhello\n"
    first, again = (nano("chat", "glm-5.2-random", "--max-tokens", "12", stdin=session) for _ in range(2))
    assert first.exit_code == again.exit_code == 0, first.output + again.output
    assert first.stderr.count("generation:") == again.stderr.count("generation:") == 3
    assert first.stdout != again.stdout


def test_greedy_reply_runs_to_max_tokens_or_stops(tiny_glm5):
    """The CLI's greedy reply is the API's greedy continuation, generated here with the stop rule off
    (`ignore_eos`) and cut by hand at the first stop token: it stops there, or runs to exactly --max-tokens."""
    reply = chat_json("--temperature", "0", "--max-tokens", "5", "--dtype", "float32", model=str(tiny_glm5))
    llm = LLM(str(tiny_glm5), dtype="float32", progress=False)
    prompt = llm.tokenizer.encode_chat([{"role": "user", "content": "hello"}])
    continuation = llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True))[0]
    stops = set(llm.tokenizer.eos_token_ids) | set(llm.config.eos_token_ids)
    first_stop = next((i for i, token in enumerate(continuation.token_ids) if token in stops), None)
    if first_stop is None:
        expected = (continuation.token_ids, 5, "length")
    else:
        expected = (continuation.token_ids[:first_stop + 1], first_stop + 1, "stop")
    assert (reply["token_ids"], reply["completion_tokens"], reply["finish_reason"]) == expected


def test_json_without_prompt_is_a_usage_error():
    assert_user_error(nano("chat", "glm-5.2-random", "--json"), "--json needs -p", exit_code=2)


# ---- bad input: one line, no traceback; exit 2 for a bad command line, 1 for a failure -----------------------
@pytest.mark.parametrize("flags,fragment", [
    (["--temperature", "-0.5"], "'--temperature'"),
    (["--top-p", "0"], "--top-p must be in (0, 1]"),
    (["--top-p", "1.5"], "--top-p must be in (0, 1]"),
    (["--top-k", "-1"], "'--top-k'"),
    (["--max-tokens", "0"], "'--max-tokens'"),
    (["--seed", "-3"], "'--seed'"),
])
def test_bad_sampling_flags(flags, fragment):
    """Each message names the flag as typed (not the SamplingParams field), exit 2: the command line is wrong."""
    result = nano("chat", "glm-5.2-random", "-p", "hi", *flags)
    assert_user_error(result, fragment, exit_code=2)
    assert result.stderr.count("\n") == 1, "flags must be checked before the model loads"


def test_unknown_model_name():
    assert_user_error(nano("chat", "no-such-model", "-p", "hi"), "no-such-model")


def test_nonexistent_directory(tmp_path):
    missing = tmp_path / "nothing-here"
    assert_user_error(nano("chat", str(missing), "-p", "hi"), "nothing-here")


def test_weights_directory_that_does_not_exist(tmp_path):
    assert_user_error(nano("chat", "kimi-k2.6-random", "--weights", str(tmp_path / "gone"), "-p", "hi"), "gone")


def test_directory_without_config(tmp_path):
    assert_user_error(nano("chat", str(tmp_path), "-p", "hi"), "config.json")


def test_unsupported_model_type(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama", "hidden_size": 64}))
    assert_user_error(nano("chat", str(tmp_path), "-p", "hi"), "llama")


def test_prompt_longer_than_the_context():
    result = nano("chat", "glm-5.2-random", "-p", "x" * 5000, "--max-tokens", "4")   # the stand-in: 4096 byte tokens
    assert_user_error(result, "context")


def test_bad_dtype_is_a_usage_error():
    result = nano("chat", "glm-5.2-random", "-p", "hi", "--dtype", "int3")
    assert result.exit_code == 2 and "Traceback" not in result.output


# ---- the KV cache: flags, /stats, /pages ---------------------------------------------------------------------
@pytest.mark.parametrize("flags,fragment", [
    (["--kv-dtype", "fp4"], "--kv-dtype must be one of auto, fp32, bf16, fp8"),
    (["--kv-budget", "lots"], "--kv-budget: cannot read the size 'lots'"),
    (["--kv-budget", "0"], "--kv-budget: a size must be positive"),
    (["--page-size", "0"], "'--page-size'"),
    (["--max-running", "0"], "'--max-running'"),
])
def test_bad_kv_flags(flags, fragment):
    result = nano("chat", "glm-5.2-random", "-p", "hi", *flags)
    assert_user_error(result, fragment, exit_code=2)
    assert result.stderr.count("\n") == 1, "flags must be checked before the model loads"


def stand_in_bytes_per_token(kv_dtype: str) -> int:
    return ModelConfig.from_hf(PRESETS["glm-5.2"].nano_config).kv_bytes_per_token(kv_dtype)


def test_kv_budget_smaller_than_one_page():
    assert_user_error(nano("chat", "glm-5.2-random", "-p", "hi", "--kv-budget", "1KiB"),
                      "holds no page of --page-size 64 tokens")


def test_conversation_larger_than_the_pool():
    one_page = str(stand_in_bytes_per_token("fp8") * 8)           # a pool of one 8-token page
    result = nano("chat", "glm-5.2-random", "-p", "hello", "--kv-dtype", "fp8", "--page-size", "8",
                  "--kv-budget", one_page)
    assert_user_error(result, "the prompt (11 tokens) + one output token is more than the KV pool holds (8 tokens): "
                              "use a shorter message or a bigger --kv-budget")


SMALL_POOL = ["--kv-dtype", "fp8", "--page-size", "8", "--kv-budget", str(stand_in_bytes_per_token("fp8") * 64)]
LONG_TURN = "x" * 50   # 56 prompt tokens: GLM's template adds [gMASK] <sop> <|user|> \n ... <|assistant|> \n


def test_a_conversation_past_80_percent_of_the_pool_is_warned_then_told_to_reset():
    """A 64-token pool: a 56-token first turn and its reply fill more than 80% of it, which /stats warns about
    (the share from the reply's own counts); the next turn (the conversation, 81 tokens at least, + 4) cannot fit,
    and its error names /reset."""
    result = nano("chat", "glm-5.2-random", *SMALL_POOL, "--max-tokens", "4", "--temperature", "0",
                  stdin=f"{LONG_TURN}\n/stats\nhi there, how are you\n")
    summary = next(line for line in result.stderr.splitlines() if line.startswith("prompt: "))
    prompt, generated = (int(n) for n in re.findall(r"(\d+) tokens", summary))
    assert prompt == 56
    assert f"warning:    the conversation fills {100 * (prompt + generated) / 64:.1f}% of the 64 tokens one request " \
           f"may hold (the KV pool); once it outgrows them, every message fails until /reset" in result.stdout
    assert_user_error(result, "is more than the KV pool holds (64 tokens): the conversation has outgrown it: every "
                              "message fails the same way until /reset starts a new one")


def test_a_conversation_that_outgrew_the_pool_fails_until_reset():
    """On a terminal an error ends only that reply: the outgrown conversation fails again at every message, with the
    same error, until /reset, after which the same message is answered."""
    from nano.cli.chat import Conversation
    from nano.errors import NanoError

    llm = LLM("glm-5.2-random", kv_dtype="fp8", page_size=8, kv_budget=SMALL_POOL[-1], progress=False)
    conversation = Conversation(llm, SamplingParams(temperature=0, max_tokens=4), None, True)
    conversation.reply(LONG_TURN)
    errors = []
    for _ in range(2):
        with pytest.raises(NanoError, match="until /reset starts a new one$") as error:
            conversation.reply("hi there, how are you")
        errors.append(str(error.value))
    assert errors[0] == errors[1]
    conversation.reset()
    assert conversation.reply("hi there, how are you").finish_reason in ("stop", "length")


def test_max_tokens_past_the_context_is_a_usage_error():
    """Refused as the server refuses max_tokens (exit 2, one line), from the prompt's tokens: "hi" in GLM's template
    is 8 byte tokens ([gMASK] <sop> <|user|> \n h i <|assistant|> \n); without -p, an empty message's 6 at least."""
    assert_user_error(nano("chat", "glm-5.2-random", "-p", "hi", "--max-tokens", "5000"),
                      "error: the prompt (8 tokens) + max_tokens (5000) is more than the model's context (4096 "
                      "tokens): use --max-tokens 4088 or less", exit_code=2)
    assert_user_error(nano("chat", "glm-5.2-random", "--max-tokens", "4091", stdin="hi\n"),
                      "the prompt (at least 6 tokens) + max_tokens (4091) is more than the model's context (4096 "
                      "tokens): use --max-tokens 4090 or less", exit_code=2)


def test_chat_second_turn_takes_the_first_from_the_prefix_cache(tiny_glm5):
    """The second turn's prompt starts with the first turn's (the template renders the whole conversation), so it
    takes at least the first prompt's whole pages from the cache; /stats counts what the replies say."""
    session = "hello there, how are you\nand what about tomorrow\n/stats\n"
    result = nano("chat", str(tiny_glm5), "--page-size", "8", "--max-tokens", "4", "--temperature", "0",
                  stdin=session)
    assert result.exit_code == 0, result.output
    first, second = (line for line in result.stderr.splitlines() if line.startswith("prompt: "))
    first_prompt = int(re.match(r"prompt: (\d+) tokens,", first).group(1))
    second_prompt, taken = (int(n) for n in re.match(r"prompt: (\d+) tokens \((\d+) from the prefix cache\)",
                                                     second).groups())
    assert taken % 8 == 0 and 8 * (first_prompt // 8) <= taken < second_prompt
    rate = 100 * taken / (first_prompt + second_prompt)
    assert f"prefix cache: on · {taken} of {first_prompt + second_prompt} prompt tokens this session came from it " \
           f"({rate:.1f}% hit rate)" in result.stdout
    off = nano("chat", str(tiny_glm5), "--max-tokens", "2", "--no-prefix-cache", stdin="hi\n/stats\n")
    assert "prefix cache: off (--no-prefix-cache)" in off.stdout


def test_fp8_chat_stats_and_pages():
    session = "/pages\nhello\n/stats\n/pages\n"
    result = nano("chat", "glm-5.2-random", "--kv-dtype", "fp8", "--kv-budget", "32MiB", "--page-size", "8",
                  "--max-tokens", "30", "--temperature", "0", stdin=session)
    assert result.exit_code == 0, result.output
    assert "no reply yet" in result.stdout                                 # /pages before the first reply

    summary = next(line for line in result.stderr.splitlines() if line.startswith("prompt: "))
    prompt, generated = (int(n) for n in re.findall(r"(\d+) tokens", summary))
    cached = prompt + generated - 1                                        # the last token is sampled, not cached
    used = -(-cached // 8)
    pages = 32 * 2**20 // (stand_in_bytes_per_token("fp8") * 8)
    assert f"KV pool:    fp8 (token layout), 8-token pages: 0 used (peak {used}), {pages:,} free, {pages:,} total; " \
           f"32.0 MiB for {pages * 8:,} tokens" in result.stdout           # the reply's pages are free again
    assert re.search(r"engine: +\d+ steps, 0 preemptions, peak 1 running", result.stdout)

    assert f"request 0: {cached} tokens cached in {used} pages of 8 tokens\neach page: " in result.stdout
    assert ", fp8 (token layout)\n" in result.stdout
    row = r" *\d+ +\d+ +\d+ +\d+–\d+ +\d+/8 *"                            # page, physical, tag, tokens, filled
    rows = [line.split() for line in result.stdout.splitlines() if re.fullmatch(row, line)]
    assert [int(r[0]) for r in rows] == list(range(used))
    assert len({r[1] for r in rows}) == used                               # distinct physical pages
    assert all(r[2] == "1" for r in rows)                                  # each page allocated once so far
    assert [r[3] for r in rows] == [f"{i * 8}–{min(i * 8 + 7, cached - 1)}" for i in range(used)]
    assert rows[-1][4] == f"{cached - 8 * (used - 1)}/8"                   # how full the last page is
    assert "full pages stay in the prefix cache" in result.stdout


# ---- interactive chat, stdin piped ---------------------------------------------------------------------------
def test_slash_commands(tiny_glm5):
    session = "hello\n/stats\n/reset\n/stats\n/help\n/bogus\n/exit\nnever sent\n"
    result = nano("chat", str(tiny_glm5), "--max-tokens", "6", "--seed", "0", stdin=session)
    assert result.exit_code == 0, result.output
    assert result.stderr.count("generation:") == 1                      # one reply; "never sent" was not
    assert "last reply: prompt:" in result.stdout and "1 reply," in result.stdout
    assert "conversation cleared" in result.stdout
    assert "context:    0 / 4,096 tokens" in result.stdout              # /stats after /reset
    assert "warning:" not in result.stdout                              # a few tokens of 4,096: no warning
    assert all(command in result.stdout for command in ("/reset", "/pages", "/exit"))   # /help
    assert "unknown command /bogus" in result.stderr


def test_conversation_is_multi_turn(tiny_glm5):
    result = nano("chat", str(tiny_glm5), "--max-tokens", "4", "--system", "be brief", stdin="one\ntwo\n/stats\n")
    assert result.exit_code == 0, result.output   # end of input ends the session
    assert result.stderr.count("generation:") == 2
    first, second = [int(line.split("prompt: ")[1].split()[0])
                     for line in result.stderr.splitlines() if line.startswith("prompt: ")]
    assert second > first + len("two")                                  # turn two carries turn one


def test_piped_turn_longer_than_the_context_fails():
    result = nano("chat", "glm-5.2-random", "--max-tokens", "4", stdin="y" * 5000 + "\n")
    assert_user_error(result, "context")


def test_terminal_output_escapes_control_characters():
    assert terminal_safe("a\x1b[2Jb\n\tc\x07\x9b") == "a\\x1b[2Jb\n\tc\\x07\\x9b"


def corrupt_checkpoint(path: Path, damage: str) -> Path:
    """A tiny real checkpoint (with tokenizer) broken in one way."""
    from fixtures import build_tokenizer_dir, make_checkpoint, read_config, read_tensors, write_checkpoint

    src = make_checkpoint(path / "src", "glm_moe_dsa", vocab_size=512)  # room for the test tokenizer
    build_tokenizer_dir(src)
    tensors, config = read_tensors(src), read_config(src)
    name = "model.layers.1.self_attn.kv_b_proj.weight"
    if damage == "shape":
        tensors[name] = tensors[name][:, :-1]
    elif damage == "missing":
        del tensors[name]
    elif damage == "unexpected":
        tensors["model.layers.1.self_attn.extra.weight"] = torch.zeros(2, 2)
    elif damage == "non-finite":
        tensors[name][0, 0] = float("nan")
    dst = write_checkpoint(path / damage, tensors, config, src)
    if damage == "truncated":
        weights = dst / "model.safetensors"
        weights.write_bytes(weights.read_bytes()[:-1000])
    return dst


@pytest.mark.parametrize("damage,fragment", [
    ("shape", "kv_b_proj.weight has shape"), ("missing", "missing 1 tensors"), ("unexpected", "extra.weight"),
    ("non-finite", "NaN"), ("truncated", "model.safetensors"),
])
def test_broken_checkpoints_fail_with_one_line(tmp_path, damage, fragment):
    assert_user_error(nano("chat", str(corrupt_checkpoint(tmp_path, damage)), "-p", "hi"), fragment)


def test_chat_with_a_checkpoint_directory(tmp_path):
    ckpt = corrupt_checkpoint(tmp_path, "none")
    result = nano("chat", str(ckpt), "-p", "hello world", "--max-tokens", "5", "--temperature", "0", "--json")
    assert result.exit_code == 0, result.output
    reply = json.loads(result.stdout)
    assert reply["label"].startswith(f"checkpoint {ckpt}") and 1 <= reply["completion_tokens"] <= 5
