"""What a newcomer types, right or wrong: one meaning per flag, one error line per mistake, one exit-code convention.

The convention (cli/console.py): exit 2 when the command line itself is wrong (Click's errors, values out of
range, flags that conflict or would do nothing), exit 1 when a command could not be carried out (a missing model
or file, an unwritable output path, memory too small), 0 otherwise; never a traceback.
"""
from __future__ import annotations

import importlib.metadata
import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import typer

from fixtures import assert_user_error, nano
from nano.errors import NanoError
from nano.llm import LLM
from nano.settings import default_device, free_memory

COMMANDS = ("models", "chat", "bench", "profile", "fault", "eval")
TINY_BENCH = ("--concurrency", "2", "--num-prompts", "2", "--input-len", "8", "--output-len", "2", "--warmup", "0")
TINY_PROFILE = ("--batch", "1", "--input-len", "8", "--steps", "1")
# Commands that run to the end do it on conftest.py's tiny GLM-5 checkpoint (`tiny`): what is checked here is the
# command line's plumbing, the same for any model, and a step of it costs a seventh of the stand-in's. Command lines
# refused before anything loads name the glm-5.2-random stand-in, as a newcomer would.


@pytest.fixture
def tiny(tiny_glm5: Path) -> str:
    return str(tiny_glm5)


# ---- one exit-code convention, every command ---------------------------------------------------------------------
@pytest.mark.parametrize("command", COMMANDS)
def test_an_unknown_flag_is_one_line_and_exit_2_in_every_command(command):
    args = [command] if command == "models" else [command, "glm-5.2-random"]
    result = nano(*args, "--no-such-flag")
    assert_user_error(result, "No such option: --no-such-flag", exit_code=2)
    assert f"'nano {command} -h'" in result.stderr


@pytest.mark.parametrize("args, flag", [
    (["chat", "glm-5.2-random", "-p", "hi", "--max-tokens", "0"], "--max-tokens"),
    (["bench", "glm-5.2-random", "--concurrency", "0"], "--concurrency"),
    (["bench", "glm-5.2-random", "--warmup", "-1"], "--warmup"),
    (["profile", "glm-5.2-random", "--steps", "0"], "--steps"),
    (["profile", "glm-5.2-random", "--input-len", "1"], "--input-len"),
    (["fault", "glm-5.2-random", "--double-alloc", "--max-tokens", "1"], "--max-tokens"),
    (["chat", "glm-5.2-random", "-p", "hi", "--threads", "0"], "--threads"),
    (["chat", "glm-5.2-random", "-p", "hi", "--seed", str(2**64)], "--seed"),      # once a ValueError from torch
    (["bench", "glm-5.2-random", "--seed", "-1"], "--seed"),
])
def test_a_value_out_of_range_names_the_flag_as_typed_and_exits_2(args, flag):
    result = nano(*args)
    assert_user_error(result, f"'{flag}'", exit_code=2)
    assert "_" not in result.stderr                          # never the Python name of a flag (max_tokens)
    assert result.stderr.count("\n") == 1, "checked before anything loads"


@pytest.mark.parametrize("command", ["chat", "bench", "profile", "fault"])
def test_an_unknown_model_is_exit_1_in_every_command(command):
    args = {"chat": ["-p", "hi"], "bench": list(TINY_BENCH), "profile": list(TINY_PROFILE),
            "fault": ["--double-alloc"]}[command]
    assert_user_error(nano(command, "no-such-model", *args), "no-such-model", exit_code=1)


@pytest.mark.parametrize("args, message", [
    (["chat", "glm-5.2-random", "-p", ""], "--prompt is empty"),
    (["chat", "glm-5.2-random", "-p", "  \n "], "--prompt is empty"),
    (["bench", "glm-5.2-random", "--input-len", "5-"], "--input-len takes a length or a range"),   # once read as 5
    (["bench", "glm-5.2-random", "--compare", ""], "--compare takes KEY=A,B"),            # once a silent single run
    (["bench", "glm-5.2-random", "--sweep-concurrency", ""], "--sweep-concurrency takes numbers"),
])
def test_values_that_once_ran_as_something_else_are_refused(args, message):
    assert_user_error(nano(*args), message, exit_code=2)


@pytest.mark.parametrize("args, message", [
    (["bench", "glm-5.2-random", "--kv-budget", "10KiB"], "--kv-budget 10KiB holds no page of --page-size 64 tokens"),
    (["fault", "glm-5.2-random", "--double-alloc", "--page-size", "100000"],
     "holds no page of --page-size 100000 tokens"),                         # the default budget: named as such
    (["chat", "glm-5.2-random", "-p", "hi", "--threads", str(len(os.sched_getaffinity(0)) + 1)], "cores this process"),
])
def test_limits_of_the_model_or_machine_name_the_flags_and_exit_1(args, message):
    result = nano(*args)
    assert_user_error(result, message, exit_code=1)
    assert result.stderr.count("\n") == 1, "found before the model loads"


# ---- flags that would do nothing are refused (or warned about), never silently ignored --------------------------
@pytest.mark.parametrize("args, message", [
    (["chat", "glm-5.2-random", "-p", "hi", "--disagg", "--kv-dtype", "fp8"], "--kv-dtype does nothing with --disagg"),
    (["chat", "glm-5.2-random", "-p", "hi", "--prefill-kv-dtype", "bf16"], "--prefill-kv-dtype needs --disagg"),
    (["chat", "glm-5.2-random", "-p", "hi", "--decode-kv-dtype", "fp8"], "--decode-kv-dtype needs --disagg"),
    (["chat", "glm-5.2-random", "-p", "hi", "--transport", "gloo"], "--transport needs --disagg"),
    (["bench", "glm-5.2-random", "--transport", "shm"], "--transport needs --disagg"),
    (["chat", "glm-5.2-random", "-p", "hi", "--int4-all"], "--int4-all needs int4 weights"),
    (["chat", "glm-5.2-random", "-p", "hi", "--int4-all", "--weights", "fp8"], "--int4-all needs int4 weights"),
    (["fault", "glm-5.2-random", "--kill-prefill", "--trials", "3"], "--trials does nothing with --kill-prefill"),
    (["fault", "glm-5.2-random", "--kill-prefill", "--no-integrity"],
     "--no-integrity does nothing with --kill-prefill"),
    (["fault", "glm-5.2-random", "--corrupt-transfer", "--page-size", "8"], "--page-size does nothing with"),
    (["bench", "glm-5.2-random", "--sweep-concurrency", "1,2", "--concurrency", "4"],
     "--concurrency does nothing with --sweep-concurrency"),
    (["bench", "glm-5.2-random", "--reproduce-blog", "--num-prompts", "3"], "--num-prompts does nothing with"),
    (["chat", "glm-5.2-random", "--json"], "--json needs -p/--prompt"),
    (["chat", "glm-5.2-random", "-p", "hi", "--kv-layout", "tile"], "--kv-layout lays out FP8 pages"),
    (["bench", "glm-5.2-random", "--kv-dtype", "bf16", "--kv-layout", "tensor"], "--kv-layout lays out FP8 pages"),
    (["chat", "glm-5.2-random", "-p", "hi", "--kv-dtype", "fp8", "--kv-layout", "diagonal"],
     "--kv-layout must be one of token, tensor, tile"),
    (["eval", "glm-5.2", "--compare", "kv-dtype=bf16,fp8:diagonal"], "fp8:LAYOUT (LAYOUT one of token, tensor, tile)"),
    (["eval", "glm-5.2", "--compare", "kv-dtype=bf16:tile"], "fp8:LAYOUT"),
])
def test_a_flag_that_would_do_nothing_is_refused(args, message):
    result = nano(*args)
    assert_user_error(result, message, exit_code=2)
    assert result.stderr.count("\n") == 1, "refused before anything loads"


def test_the_layout_goes_to_the_fp8_side_of_a_split_and_its_one_process_twin():
    """--kv-layout lays out FP8 pages: with --disagg it reaches the worker whose pool is FP8 and not the BF16 one, and
    the one process bench --disagg compares with (the decode side's KV dtype) has it only if that side is FP8."""
    from nano.cli.options import EngineOptions
    from nano.settings import EngineConfig

    for prefill, decode in (("fp8", "bf16"), ("bf16", "fp8")):
        split = EngineOptions(EngineConfig(kv_layout="tile"), disagg=True, prefill_kv_dtype=prefill,
                              decode_kv_dtype=decode, typed=frozenset({"kv_layout"}))
        split.check()
        workers = split.worker_configs()
        assert {role: (c.kv_dtype, c.kv_layout) for role, c in workers.items()} == {
            "prefill": (prefill, "tile" if prefill == "fp8" else "token"),
            "decode": (decode, "tile" if decode == "fp8" else "token")}
        twin = split.single_process_twin()
        twin.check()
        assert (twin.config.kv_dtype, twin.config.kv_layout) == (decode, "tile" if decode == "fp8" else "token")


@pytest.mark.parametrize("layout", ["token", "tensor", "tile"])
def test_each_fp8_layout_runs_and_says_so(tiny, layout):
    result = nano("chat", tiny, "--kv-dtype", "fp8", "--kv-layout", layout, "--kv-budget", "1MiB", "--max-tokens", "2",
                  "--temperature", "0", stdin="hi\n/stats\n")
    assert result.exit_code == 0, result.output
    assert f"KV pool:    fp8 ({layout} layout), " in result.stdout


def test_the_same_flags_in_a_combination_where_they_act_are_accepted(tiny):
    """The refusals above are about the combination: --int4-all with int4 weights runs (and changes the output
    format the run reports); --kv-dtype without --disagg runs."""
    plain = nano("chat", tiny, "-p", "hi", "--max-tokens", "2", "--temperature", "0", "--weights", "int4", "--json")
    packed = nano("chat", tiny, "-p", "hi", "--max-tokens", "2", "--temperature", "0", "--weights", "int4",
                  "--int4-all", "--kv-dtype", "fp8", "--json")
    assert plain.exit_code == 0 and packed.exit_code == 0, plain.output + packed.output
    assert "warning" not in packed.stderr


@pytest.mark.parametrize("flag", ["--seed", "--top-k", "--top-p"])
def test_sampling_flags_under_greedy_decoding_are_warned_about(tiny, flag):
    value = {"--seed": "3", "--top-k": "5", "--top-p": "0.5"}[flag]
    result = nano("chat", tiny, "-p", "hi", "--max-tokens", "2", "--temperature", "0", flag, value)
    assert result.exit_code == 0, result.output
    assert f"warning: {flag} does nothing while --temperature is 0" in result.stderr
    quiet = nano("chat", tiny, "-p", "hi", "--max-tokens", "2", "--temperature", "0.5", flag, value)
    assert quiet.exit_code == 0 and "warning" not in quiet.stderr


# ---- input that is not UTF-8 --------------------------------------------------------------------------------------
def test_a_prompt_that_is_not_utf8_is_refused(tiny):
    undecodable = b"caf\xe9".decode("utf-8", "surrogateescape")    # how Python hands over a latin-1 argument
    assert_user_error(nano("chat", "glm-5.2-random", "-p", undecodable), "--prompt is not valid UTF-8 text",
                      exit_code=2)
    assert_user_error(nano("chat", "glm-5.2-random", "-p", "hi", "--system", undecodable),
                      "--system is not valid UTF-8", exit_code=2)
    with pytest.raises(NanoError, match="not valid UTF-8"):
        LLM(tiny, kv_budget="1MiB").generate([undecodable])


@pytest.mark.parametrize("decoding", ["strict", "surrogateescape"])
def test_piped_input_that_is_not_utf8_ends_with_one_error_line(tiny, decoding):
    """A real pipe, both ways Python may decode it (a UTF-8 locale decodes strictly, the C locale leniently): the
    turn before the bad line is answered, then one error line and exit 1."""
    done = subprocess.run([sys.executable, "-m", "nano", "chat", tiny, "--max-tokens", "2"],
                          input=b"hi\n\xff\xfe oops\nnever read\n", capture_output=True, timeout=120,
                          env={**os.environ, "PYTHONIOENCODING": f"utf-8:{decoding}", "OMP_NUM_THREADS": "1"})
    stderr = done.stderr.decode()
    assert done.returncode == 1, stderr
    assert stderr.strip().splitlines()[-1] == "error: the input is not valid UTF-8 text", stderr
    assert "Traceback" not in stderr and stderr.count("generation:") == 1     # the first turn was answered


# ---- memory and output paths, checked before the work -------------------------------------------------------------
def test_a_kv_budget_larger_than_free_memory_is_one_line_before_anything_loads():
    too_much = f"{free_memory(default_device()) // 2**30 + 64}GiB"
    result = nano("chat", "glm-5.2-random", "-p", "hi", "--kv-budget", too_much)
    assert_user_error(result, f"--kv-budget {too_much} is more than the free memory", exit_code=1)
    assert result.stderr.count("\n") == 1, "no model line: refused before loading"
    with pytest.raises(NanoError, match="more than the free memory"):   # the library refuses it too
        LLM("glm-5.2-random", kv_budget=too_much)


@pytest.mark.parametrize("args, flag", [
    (["profile", *TINY_PROFILE, "--trace"], "--trace"),
    (["bench", *TINY_BENCH, "--output"], "--output"),
])
def test_output_paths_are_checked_before_the_work_starts(tmp_path, tiny, args, flag):
    args = [args[0], tiny, *args[1:]]
    missing = nano(*args, str(tmp_path / "no-such-dir" / "out.json"))
    assert_user_error(missing, f"{flag} {tmp_path / 'no-such-dir' / 'out.json'}: the directory", exit_code=1)
    assert missing.stderr.count("\n") == 1, "refused before the model loads"
    folder = nano(*args, str(tmp_path))
    assert_user_error(folder, "is a directory", exit_code=1)
    target = tmp_path / "out.json"
    written = nano(*args, str(target))
    assert written.exit_code == 0, written.output
    assert target.stat().st_size > 0 and f"wrote {target}" in written.stderr


# ---- --json means one thing: one JSON object on stdout ------------------------------------------------------------
@pytest.mark.parametrize("args", [      # bench and profile: test_threads_sets_torch_threads, with --json too
    ["models"],
    ["models", "--capacity"],
    ["chat", "-p", "hi", "--max-tokens", "2"],
    ["fault", "--double-alloc", "--requests", "2", "--max-tokens", "4"],
])
def test_json_prints_exactly_one_json_value_on_stdout(request, args):
    if args[0] != "models":
        args = [args[0], request.getfixturevalue("tiny"), *args[1:]]
    result = nano(*args, "--json")
    assert result.exit_code == 0, result.output
    json.loads(result.stdout)         # the whole of stdout parses: no table, no progress


def test_bench_json_and_output_carry_the_same_report(tmp_path, tiny):
    """`--json` is a flag in bench as everywhere (the old `--json FILE` swallowed the next argument), and
    `--output FILE` writes the same object."""
    target = tmp_path / "bench.json"
    result = nano("bench", tiny, "--json", *TINY_BENCH, "--output", str(target))
    assert result.exit_code == 0, result.output
    assert json.loads(result.stdout) == json.loads(target.read_text())
    assert json.loads(result.stdout)["runs"][0]["results"][0]["completed"] == 2


# ---- conventional help ----------------------------------------------------------------------------------------------
def test_help_is_plain_text_with_whole_descriptions():
    from nano.cli.main import app

    result = nano("--help")
    assert result.exit_code == 0
    assert not set("│╭╰─") & set(result.stdout)                                  # no boxes
    assert "<bool>" not in result.stdout and "<str>" not in result.stdout       # no type placeholders
    listing = " ".join(result.stdout.partition("Commands:")[2].split())
    for name, command in typer.main.get_group(app).commands.items():
        first_paragraph = " ".join(command.help.split("\n\n")[0].split())
        assert f"{name} {first_paragraph}" in listing                # the whole first sentence, not cut with "..."
    assert nano("-h").stdout == result.stdout


@pytest.mark.parametrize("command", COMMANDS)
def test_every_command_help_has_no_type_placeholders(command):
    result = nano(command, "-h")
    assert result.exit_code == 0
    assert not re.search(r"<(bool|str|int|float)>", result.stdout), result.stdout


def test_profile_help_mentions_no_flag_profile_does_not_take():
    from nano.cli.main import app

    profile = typer.main.get_group(app).commands["profile"]
    offered = {opt for param in profile.params for opt in (*param.opts, *param.secondary_opts)}
    mentioned = set(re.findall(r"--[a-z][a-z0-9-]+", nano("profile", "-h").stdout)) - {"--help"}
    assert mentioned <= offered, sorted(mentioned - offered)


def test_the_fault_is_one_choice_listed_in_one_place():
    from nano.cli.fault import ALL_FAULTS

    text = nano("fault", "-h").stdout
    block = text.partition("FAULT, exactly one of:")[2].partition("\n\n")[0]
    assert [line.split()[0] for line in block.splitlines() if line.strip().startswith("--")] == \
        [f"--{kind}" for kind in ALL_FAULTS]
    assert "Options:" in text and not any(f"--{kind}" in text.partition("Options:")[2] for kind in ALL_FAULTS)


def test_version():
    result = nano("--version")
    assert result.exit_code == 0
    assert result.stdout.startswith(f"nano {importlib.metadata.version('nano')} ")


def test_no_command_prints_the_help_and_exits_0():
    result = nano()
    assert result.exit_code == 0 and "Commands:" in result.stdout


# ---- threads ---------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("args", [
    ["bench", *TINY_BENCH],
    ["profile", *TINY_PROFILE],
])
def test_threads_sets_torch_threads(tiny, args):
    """Also --json in bench and profile: the whole of stdout is one JSON value."""
    import torch

    before = torch.get_num_threads()
    try:
        result = nano(args[0], tiny, *args[1:], "--threads", "1", "--json")
        assert result.exit_code == 0, result.output
        report = json.loads(result.stdout)
        if "environment" in report:
            assert report["environment"]["torch_threads"] == 1
        assert torch.get_num_threads() == 1
    finally:
        torch.set_num_threads(before)


@pytest.mark.skipif(not Path("/proc/self/maps").exists(), reason="needs /proc to find the libgomp torch loads")
def test_waiting_threads_spin_briefly_unless_the_user_says_otherwise():
    """The spin count reaches the OpenMP runtime torch loads: libgomp reports its settings itself when it loads
    (OMP_DISPLAY_ENV=VERBOSE). Its default spins 300,000 times; nano's 1,000; a user's policy stands. One process
    imports nano, then torch, and names the libgomp it mapped; the other cases load that same library by itself
    (ctypes), which reads the environment as it does under torch, without the seconds a torch import costs."""
    def spin_count(code: str, **env: str) -> tuple[str, str]:
        base = {k: v for k, v in os.environ.items() if k not in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")}
        done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                              env={**base, "OMP_DISPLAY_ENV": "VERBOSE", **env})
        found = re.search(r"GOMP_SPINCOUNT = '(\d+)'", done.stderr)
        if found is None:
            pytest.skip(f"this torch does not use libgomp ({done.stderr[-300:]})")
        return found.group(1), done.stdout

    under_torch, mapped = spin_count("import nano, torch; torch.ones(64, 64) @ torch.ones(64, 64); print(*{line.split()"
                                     "[-1] for line in open('/proc/self/maps') if 'libgomp' in line})")
    assert under_torch == "1000"                                            # nano first, then torch
    [libgomp] = mapped.split()
    load = f"import ctypes; ctypes.CDLL({libgomp!r})"
    assert spin_count(load)[0] == "300000"                                  # libgomp alone: its default
    assert spin_count(f"import nano; {load}", OMP_WAIT_POLICY="PASSIVE")[0] == "0"   # the user's choices stand
    assert spin_count(f"import nano; {load}", GOMP_SPINCOUNT="5")[0] == "5"
    # torch first: libgomp spins its default, nano does not pretend otherwise and runs one thread
    base = {k: v for k, v in os.environ.items() if k not in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT", "OMP_NUM_THREADS")}
    done = subprocess.run([sys.executable, "-c", "import os, torch, nano; from nano.llm import default_threads; "
                           "print(default_threads(), 'GOMP_SPINCOUNT' in os.environ)"],
                          capture_output=True, text=True, timeout=120, env=base)
    assert done.stdout.split() == ["1", "False"], done.stderr


@pytest.mark.parametrize("load, expected", [(0.2, 4), (1.5, 3), (3.0, 1), (9.0, 1)])
def test_default_threads_leave_the_cores_others_keep_busy(monkeypatch, load, expected):
    """4 CPUs, all ours: an idle machine gets a thread per core; each CPU's worth of other load takes one away
    (a partly free core still gets a thread); never fewer than one. OMP_NUM_THREADS, when set, wins. Under libgomp's
    long default spin (no spin policy in the environment: torch was imported before nano) one thread."""
    from nano import llm

    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.delenv("OMP_WAIT_POLICY", raising=False)
    monkeypatch.setenv("GOMP_SPINCOUNT", "1000")
    monkeypatch.setattr(llm.os, "sched_getaffinity", lambda pid: {0, 1, 2, 3})
    monkeypatch.setattr(llm.os, "cpu_count", lambda: 4)
    monkeypatch.setattr(llm.os, "getloadavg", lambda: (load, load, load))
    assert llm.default_threads() == expected
    monkeypatch.delenv("GOMP_SPINCOUNT")
    assert llm.default_threads() == 1
    monkeypatch.setenv("OMP_NUM_THREADS", "3")
    monkeypatch.setattr(llm.torch, "get_num_threads", lambda: 3)
    assert llm.default_threads() == 3


def test_engines_built_one_after_another_keep_the_first_engines_thread_count(monkeypatch, tiny):
    """A --compare builds its configurations one after another in one process, and each run raises the load
    average the next one's default would read: the process's first choice holds for all of them."""
    import torch

    from nano import llm

    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.delenv("OMP_WAIT_POLICY", raising=False)
    monkeypatch.setenv("GOMP_SPINCOUNT", "1000")
    monkeypatch.setattr(llm.os, "sched_getaffinity", lambda pid: {0, 1})
    monkeypatch.setattr(llm.os, "cpu_count", lambda: 2)
    loads = iter([0.1, 1.9])     # idle at the first engine, one CPU busy at the second
    monkeypatch.setattr(llm.os, "getloadavg", lambda: (next(loads),) * 3)
    before = torch.get_num_threads()
    llm.process_threads.cache_clear()
    try:
        counts = []
        for kv_dtype in ("bf16", "fp8"):
            LLM(tiny, kv_dtype=kv_dtype, kv_budget="1MiB", progress=False).close()
            counts.append(torch.get_num_threads())
        assert counts == [2, 2]
        assert llm.default_threads() == 1          # what the second engine alone would have chosen
    finally:
        llm.process_threads.cache_clear()
        torch.set_num_threads(before)


# ---- answering at once: the command line loads no torch until a command runs --------------------------------------
ALL_COMMANDS = (*COMMANDS, "serve")
HEAVY = ("torch", "numpy", "transformers", "triton", "safetensors", "jinja2", "uvicorn")
ANSWERED_WITHOUT_TORCH = [
    (["-h"], 0), (["--version"], 0), (["--bogus"], 2),
    *[(args, code) for command in ALL_COMMANDS for args, code in (
        ([command, "-h"], 0), ([command, "--bogus"], 2), ([command, "glm-5.2", "--bogus"], 2))],
    (["chat", "glm-5.2", "--temperature", "-1"], 2), (["chat", "glm-5.2", "hi"], 2),
    (["chat", "glm-5.2", "--dtype", "fp16"], 2), (["bench", "glm-5.2", "--kv-dtype", "fp16"], 2),
    (["profile", "glm-5.2", "--prefill-weights", "fp4"], 2), (["models", "--tp", "3"], 2),
    # values checked by the library's own rules (SamplingParams, EngineConfig, nano eval's), and the model's name
    (["chat", "glm-5.2", "--top-p", "2"], 2), (["chat", "glm-5.2", "--kv-dtype", "fp16"], 2),
    (["chat", "glm-9"], 1), (["chat", "./absent"], 1), (["profile", "glm-9"], 1),
    (["eval", "glm-5.2", "--context", "1"], 2), (["eval", "glm-5.2", "--compare", "kv-dtype=fp16"], 2),
    (["eval", "glm-9"], 1), (["serve", "glm-5.2", "--max-body", "0"], 2),
    (["serve", "glm-5.2", "--kv-dtype", "fp16"], 2), (["serve", "glm-9"], 1),
]
ANSWER_IN_PROCESS = """
import contextlib, io, json, sys
from nano.cli.main import main
cases, heavy, found = json.loads(sys.argv[1]), json.loads(sys.argv[2]), []
for args in cases:
    sys.argv = ["nano", *args]
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
        try:
            main()
        except SystemExit as done:
            code = done.code
    found.append([args, code, [name for name in heavy if name in sys.modules]])
print(json.dumps(found))
"""


def test_help_version_and_command_line_errors_load_no_torch():
    """Each case runs the entry point in one fresh process, in turn; after each, torch (and the other heavy
    libraries) must still be absent from sys.modules: a module that imported one at its top would show here. The
    last case runs a command, which does load torch (so the check can fail). benchmarks/startup.py times them."""
    cases = [args for args, _ in ANSWERED_WITHOUT_TORCH] + [["models", "--json"]]
    done = subprocess.run([sys.executable, "-c", ANSWER_IN_PROCESS, json.dumps(cases), json.dumps(HEAVY)],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    *answered, ran = json.loads(done.stdout)
    assert [(args, code) for args, code, _ in answered] == [(args, code) for args, code in ANSWERED_WITHOUT_TORCH]
    assert [(args, loaded) for args, _, loaded in answered if loaded] == []
    assert ran[1] == 0 and "torch" in ran[2]


def test_a_message_typed_without_p_gets_a_hint():
    assert_user_error(nano("chat", "glm-5.2", "hi"), "to send it as a message: nano chat glm-5.2 -p hi", exit_code=2)
    assert_user_error(nano("chat", "glm-5.2-random", "hello", "there"),
                      "to send them as a message: nano chat glm-5.2-random -p 'hello there'", exit_code=2)


@pytest.mark.parametrize("args, accepted", [
    (["chat", "glm-5.2", "--dtype", "fp16"], "'fp16' is not one of 'float32', 'bfloat16'"),
    (["bench", "glm-5.2", "--endpoint", "responses"], "'responses' is not one of 'completions', 'chat'"),
])
def test_a_choice_out_of_its_list_names_the_accepted_values(args, accepted):
    result = nano(*args)
    assert_user_error(result, accepted, exit_code=2)
    assert "Value error" not in result.stderr


# ---- Ctrl-C: exit 130, no traceback, at any moment ----------------------------------------------------------------
def interrupted(model: str, wait: str) -> subprocess.CompletedProcess:
    """`nano chat MODEL`, waiting for input, sent SIGINT (as Ctrl-C does) once `wait` is true."""
    chat = subprocess.Popen([sys.executable, "-m", "nano", "chat", model], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline, first_line = time.monotonic() + 120, ""
    if wait == "torch loading":   # its shared library is mapped: the import has begun (and takes seconds)
        while "libtorch" not in Path(f"/proc/{chat.pid}/maps").read_text() and time.monotonic() < deadline:
            time.sleep(0.01)
    else:                         # the model line: the model is loaded and the chat waits for the first message
        first_line = chat.stderr.readline()
    chat.send_signal(signal.SIGINT)
    stdout, stderr = chat.communicate(timeout=120)
    return subprocess.CompletedProcess(chat.args, chat.returncode, stdout, first_line + stderr)


@pytest.mark.skipif(not Path("/proc/self/maps").exists(), reason="needs /proc to see torch loading")
@pytest.mark.parametrize("wait", ["torch loading", "the model line"])
def test_ctrl_c_exits_130_without_a_traceback(tiny, wait):
    done = interrupted(tiny, wait)
    assert done.returncode == 130 and "Traceback" not in done.stderr, done.stderr
    assert (tiny in done.stderr) == (wait == "the model line"), done.stderr
