"""The doc check: every `nano ...` command the docs show is run, and its output is compared with the doc by shape.

How a doc shows a command and its output (docs/*.md; README.md is read the same way):

    ```bash                       a command block. Each line that starts with `nano ` (or `$ nano `, or follows
    nano chat glm-5.2 --seed 0    `&&`) is a command; a trailing `\\` continues it, `# ...` is a comment. Lines
    >>> /stats                    `>>> TEXT` after a chat command are what the user types: they become its stdin.
    ```
    ```                           an output block: a plain fence right after a command block (only blank lines
    …                             between) is what that block's one command prints: stdout and stderr together,
    KV pool:    fp8, ...          as a terminal 120 columns wide shows them (COLUMNS=120, as when piped).
    ```

A plain block whose first line is `$ nano ...` is a transcript: that command, then its output. In an output block
`>>> TEXT` lines are the user's input (stdin), shown where they were typed; they are not compared.

Shape: both sides lose blank lines, runs of spaces (table column widths follow the numbers) and the length of
table rules; every number becomes `#` (with its sign and a K/M/B/T suffix: `-1,234.5`, `1.37M`, `±17%` -> `#`,
`#`, `#%`). What is left must match line for line: the words, the row and column labels, the verdicts, how many
rows a table has. In the doc, a line that is only `…` (or `...`), or only `<a description>` (`<the reply: random
bytes>`), stands for any number of lines; `…` inside a line for any text; `{yes|no}` for either word (a verdict
that the machine does not give reliably). Nothing else is loose.

A command with `--json` must print exactly one JSON value on stdout (stderr is not compared); every `"key":` the
doc shows must be in it, a string value the doc shows must match the actual one by shape, and true, false and
null must be the same. (A number as a key, a request id, stands for any number.)

An expected output with an `error: ` line means the command must fail: a non-zero exit and exactly one `error:`
line. Any other command must exit 0 and print no traceback.

Commands run in a fresh temporary directory (relative output files land there); an output path under /tmp
(`--trace /tmp/decode.json`) is moved into that directory too, and must have been written. They run in the test's
own process, as `python -m nano ...` would run them (`run_in_process` says what that takes; a fresh interpreter
and torch cost seconds per command).
"""
from __future__ import annotations

import contextlib
import importlib.util
import json
import os
import re
import shlex
import sys
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
DOCS = sorted((REPO_ROOT / "docs").glob("*.md")) + [REPO_ROOT / "README.md"]
COMMANDS = {"models", "chat", "bench", "profile", "fault", "eval"}
OUTPUT_FLAGS = ("--trace", "--output", "--plot")          # flags whose value is a file the command writes
COLUMNS = 120

# Commands the check does not run, each with its reason. Keys are the command as the doc writes it, after the
# program name (`bench glm-5.2 --concurrency 64`), matched exactly.
EXEMPT: dict[str, str] = {
    "bench glm-5.2-random --shared-prefix 256 --input-len 32 --output-len 16 --concurrency 8 --num-prompts 32 "
    "--page-size 16 --compare prefix-cache=on,off":
        "22 s; the doc's table gives three measured runs, and "
        "tests/test_bench.py::test_bench_shared_prefix_compare_prefix_cache runs a smaller one against the same "
        "arithmetic",
    "bench glm-5.2-random --disagg --dtype bfloat16 --concurrency 8 --num-prompts 8 --input-len 512 --output-len 16":
        "about 70 s of CPU: two worker processes start, then one process, each loading the model and converting it "
        "to INT4; tests/test_bench.py::test_bench_disagg_reports_the_split_beside_one_process runs the split beside "
        "one process, smaller, and checks its figures against the workload",
    "bench glm-5.2-random --disagg --dtype bfloat16 --concurrency 8 --num-prompts 8 --input-len 512 --output-len 16 "
    "--decode-kv-dtype bf16": "the same, with no output shown (a table of its measured transfer rates); "
                              "tests/test_disagg.py covers one KV dtype on both sides (fp8)",
    "chat glm-5.2 --disagg":
        "about 14 s of CPU for its two worker processes; "
        "tests/test_no_triton.py::test_chat_without_triton_matches_chat_with_it[disagg] runs nano chat --disagg (the "
        "tiny checkpoint) and checks its `split: prefill pid` line and its reply against one process",
    "fault glm-5.2 --kill-prefill":
        "about 20 s of CPU for its three worker processes (prefill, decode, the prefill's replacement); "
        "tests/test_disagg.py::test_cli_fault_kill_prefill runs it (--json, the tiny checkpoint) and checks the "
        "aborts, the time to settle and the replacement, and test_docs checks the doc's report against "
        "print_split_fault's rendering",
    "fault glm-5.2 --corrupt-transfer --json":
        "about 16 s of CPU for its two worker processes; tests/test_disagg.py::test_cli_fault_corrupt_transfer runs "
        "it (the tiny checkpoint) and checks one abort on the checksum, no wrong answer and the others identical",
    "bench glm-5.2-random --concurrency 4 --num-prompts 4 --multi-turn 4 --shared-prefix 64 --input-len 96 "
    "--output-len 16 --page-size 16 --compare prefix-cache=on,off": "15 s; tests/test_bench.py runs --multi-turn "
                                                                    "with --shared-prefix, and --compare "
                                                                    "prefix-cache=on,off, smaller, against the "
                                                                    "same arithmetic",
    "bench glm-5.2-random --reproduce-blog": "minutes; tests/test_bench.py::test_reproduce_blog runs it on the tiny "
                                             "checkpoint at small sizes, and test_docs checks the doc's table "
                                             "against blog_table's rendering",
}




def _charts() -> dict[str, tuple[str, str]]:
    """benchmarks/charts.py's CHARTS (image -> its doc, the command that draws it), read from the script."""
    spec = importlib.util.spec_from_file_location("charts", REPO_ROOT / "benchmarks" / "charts.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.CHARTS


# The commands that draw the docs' charts (docs/images/): minutes each on the stand-ins, so not run here
CHARTS = _charts()
EXEMPT.update({command.removeprefix("nano "): f"draws docs/images/{name}, and benchmarks/charts.py runs it (minutes "
                                               f"on the stand-in); tests/test_plot.py draws every chart from fixed "
                                               f"reports and runs --plot on the tiny checkpoint, and "
                                               f"test_docs.py::test_each_chart_in_the_docs_is_drawn_by_the_command_"
                                               f"beside_it checks the image against its command"
               for name, (_, command) in CHARTS.items()})


class DocFormatError(AssertionError):
    """A doc breaks the convention above (an output block after several commands, output inside a command block)."""


@dataclass
class Example:
    doc: str                      # path relative to the repository
    line: int                     # 1-based line of the command in the doc
    text: str                     # the command as written, after `nano `
    argv: list[str]               # after `nano`
    stdin: list[str] = field(default_factory=list)
    expected: list[str] | None = None       # the output block's lines (None: no output shown)
    expected_line: int | None = None

    @property
    def id(self) -> str:
        return f"{self.doc}:{self.line}: nano {self.text}"

    @property
    def json_mode(self) -> bool:
        return "--json" in self.argv and not _takes_file(self.argv, "--json")


def _takes_file(argv: list[str], flag: str) -> bool:
    """`--json FILE` (the old `nano bench` spelling): the next word is a value, not a flag."""
    i = argv.index(flag)
    return i + 1 < len(argv) and not argv[i + 1].startswith("-")


# ---- reading the docs ------------------------------------------------------------------------------------------
@dataclass
class Block:
    lang: str
    start: int                    # 1-based line of the opening fence
    end: int                      # 1-based line of the closing fence
    lines: list[str]


def fenced_blocks(text: str) -> list[Block]:
    blocks, current, lang, start = [], None, "", 0
    for number, line in enumerate(text.splitlines(), 1):
        if current is None:
            opened = re.match(r"^```\s*([\w+-]*)\s*$", line)
            if opened:
                current, lang, start = [], opened.group(1), number
        elif re.match(r"^```\s*$", line):
            blocks.append(Block(lang, start, number, current))
            current = None
        else:
            current.append(line)
    return blocks


def _logical_lines(lines: list[str], first: int) -> list[tuple[int, str]]:
    """Join `\\`-continued lines; each with the 1-based doc line it starts on."""
    joined, buffer, at = [], "", 0
    for offset, line in enumerate(lines):
        if not buffer:
            at = first + offset
        if line.rstrip().endswith("\\"):
            buffer += line.rstrip()[:-1] + " "
            continue
        joined.append((at, buffer + line))
        buffer = ""
    if buffer:
        joined.append((at, buffer))
    return joined


def parse_command(line: str) -> tuple[str, list[str]] | None:
    """`nano bench glm-5.2 --seed 1   # comment` -> ("bench glm-5.2 --seed 1", [...]); None if the line runs no
    `nano` command. A line that starts with `nano ` but is not a command is a format error (output in a command
    block)."""
    line = line.strip().removeprefix("$ ")
    for segment in line.split("&&"):
        segment = segment.strip()
        if not re.match(r"^nano(\s|$)", segment):
            continue
        words = shlex.split(segment, comments=True)
        if len(words) < 2 or not (words[1] in COMMANDS or words[1].startswith("-")):
            raise DocFormatError(f"{segment!r} starts with `nano` but runs no command: output belongs in a plain "
                                 "``` block after the command block")
        if {"|", ">", "<", ">>", "2>&1"} & set(words):
            raise DocFormatError(f"{segment!r}: pipes and redirections are not run by the doc check")
        return " ".join(shlex.quote(w) if re.search(r"\s", w) else w for w in words[1:]), words[1:]
    return None


def examples_in(path: Path) -> list[Example]:
    text = path.read_text()
    lines = text.splitlines()
    doc = str(path.relative_to(REPO_ROOT)) if path.is_relative_to(REPO_ROOT) else str(path)
    blocks = fenced_blocks(text)
    found: list[Example] = []
    previous: tuple[Block, list[Example]] | None = None
    for block in blocks:
        follows = previous is not None and all(not lines[i - 1].strip()
                                               for i in range(previous[0].end + 1, block.start))
        if block.lang in ("bash", "sh", "shell", "console"):
            commands: list[Example] = []
            for number, line in _logical_lines(block.lines, block.start + 1):
                if line.startswith(">>> "):
                    if not commands or commands[-1].argv[0] != "chat":
                        raise DocFormatError(f"{doc}:{number}: `>>>` input with no `nano chat` command before it")
                    commands[-1].stdin.append(line[4:])
                    continue
                parsed = parse_command(line)
                if parsed is not None:
                    commands.append(Example(doc, number, *parsed))
                elif re.match(r"^\s*nano(\s|$)", line):
                    raise DocFormatError(f"{doc}:{number}: {line!r}")
            found.extend(commands)
            previous = (block, commands)
            continue
        if block.lang == "":
            first = block.lines[0] if block.lines else ""
            if first.startswith("$ nano"):                        # a transcript: command, then output
                parsed = parse_command(first)
                if parsed is None:
                    raise DocFormatError(f"{doc}:{block.start + 1}: {first!r}")
                example = Example(doc, block.start + 1, *parsed)
                attach_output(example, block.lines[1:], block.start + 2)
                found.append(example)
            elif follows and previous[1]:
                if len(previous[1]) != 1:
                    raise DocFormatError(f"{doc}:{block.start}: an output block after a command block with "
                                         f"{len(previous[1])} commands: whose output is it?")
                attach_output(previous[1][0], block.lines, block.start + 1)
            elif any(line.startswith(">>> ") for line in block.lines):
                raise DocFormatError(f"{doc}:{block.start}: a chat transcript must directly follow its command "
                                     "block (or start with `$ nano chat ...`)")
        previous = None
    return found


def attach_output(example: Example, lines: list[str], first: int) -> None:
    typed = [line[4:] for line in lines if line.startswith(">>> ")]
    if typed and example.stdin:
        raise DocFormatError(f"{example.id}: input shown both in the command block and in the output")
    example.stdin = example.stdin or typed
    example.expected = [line for line in lines if not line.startswith(">>> ")]
    example.expected_line = first


def all_examples() -> list[Example]:
    return [example for path in DOCS for example in examples_in(path)]


# ---- shape ----------------------------------------------------------------------------------------------------
NUMBER = re.compile(r"(?<![\w.#])[-+−±]?\d[\d,]*(?:\.\d+)?(?:[eE][-+]?\d+)?[KMBTk]?(?![\w])")
BOX = re.compile(r"[─━═]+")


def shape(line: str) -> str:
    """A line's shape: numbers -> #, runs of spaces and table rules collapsed."""
    line = BOX.sub("─", line.replace("\t", " "))
    line = NUMBER.sub("#", line)
    return re.sub(r"\s+", " ", line).strip()


def is_wildcard_line(line: str) -> bool:
    stripped = line.strip()
    return stripped in ("…", "...") or bool(re.fullmatch(r"<[^<>]+>", stripped))


def line_pattern(line: str) -> re.Pattern[str]:
    """The regex an expected line's shape stands for: `…` any text, `{a|b}` either word."""
    parts = re.split(r"(…|\{[^{}|]+(?:\|[^{}|]+)+\})", shape(line))
    regex = ""
    for part in parts:
        if part == "…":
            regex += ".*"
        elif part.startswith("{") and "|" in part:
            regex += "(?:" + "|".join(re.escape(choice.strip()) for choice in part[1:-1].split("|")) + ")"
        else:
            regex += re.escape(part)
    return re.compile(regex)


def match_lines(expected: list[str], actual: list[str]) -> bool:
    """Does the actual output (shaped, blank lines dropped) match the expected lines, with `…` lines standing for
    any run of lines?"""
    want = [line for line in expected if line.strip()]
    got = [shape(line) for line in actual if shape(line)]
    patterns = [None if is_wildcard_line(line) else line_pattern(line) for line in want]
    memo: dict[tuple[int, int], bool] = {}

    def walk(i: int, j: int) -> bool:
        if (i, j) in memo:
            return memo[(i, j)]
        if i == len(patterns):
            result = j == len(got)
        elif patterns[i] is None:
            result = walk(i + 1, j) or (j < len(got) and walk(i, j + 1))
        else:
            result = j < len(got) and patterns[i].fullmatch(got[j]) is not None and walk(i + 1, j + 1)
        memo[(i, j)] = result
        return result

    return walk(0, 0)


def shape_diff(expected: list[str], actual: list[str]) -> str:
    import difflib

    want = [line.strip() if is_wildcard_line(line) else shape(line) for line in expected if line.strip()]
    got = [shape(line) for line in actual if shape(line)]
    return "\n".join(difflib.unified_diff(want, got, "doc (shape)", "actual (shape)", lineterm="", n=2))


# ---- JSON -----------------------------------------------------------------------------------------------------
def _find_key(value, key: str):
    """The first value under `key`, breadth first; a number as a key (a request id) stands for any number."""
    queue = [value]
    while queue:
        item = queue.pop(0)
        if isinstance(item, dict):
            if key in item:
                return True, item[key]
            if key.isdigit():
                numbered = [k for k in item if k.isdigit()]
                if numbered:
                    return True, item[numbered[0]]
            queue.extend(item.values())
        elif isinstance(item, list):
            queue.extend(item)
    return False, None


def json_problems(expected: list[str], actual) -> list[str]:
    """Every `"key":` the doc shows is in the actual JSON; a string value it shows matches the actual's shape."""
    text = "\n".join(expected)
    problems = []
    for key, value in re.findall(r'"((?:[^"\\]|\\.)*)"\s*:\s*("(?:[^"\\]|\\.)*"|true|false|null)?', text):
        present, got = _find_key(actual, key)
        shown = json.loads(value) if value else None
        if not present:
            problems.append(f"key {key!r} is not in the output")
        elif isinstance(shown, str) and isinstance(got, str) and not line_pattern(shown).fullmatch(shape(got)):
            problems.append(f"{key!r}: the doc shows {shown!r}, the command printed {got!r}")
        elif value in ("true", "false", "null") and got is not shown:
            problems.append(f"{key!r}: the doc shows {value}, the command printed {json.dumps(got)}")
    return problems


# ---- running -------------------------------------------------------------------------------------------------
@dataclass
class Run:
    argv: list[str]
    returncode: int
    output: str                  # stdout and stderr as a terminal shows them (JSON mode: stdout only)
    stderr: str                  # JSON mode: stderr
    files: list[Path]            # the output files the command was asked to write


@contextlib.contextmanager
def weights_drawn_once() -> Iterator[None]:
    """While it lasts, a random stand-in's weights (`Transformer.init_random`) are drawn once per seed and set of
    parameters in this process, and copied into every later model that asks for the same: drawing 100M values costs
    about a second, a copy a tenth of that, and the doc commands draw the same few stand-ins again and again. The
    values are the ones a fresh draw gives (the draw depends only on the seed, std and the parameters' names, shapes
    and dtypes, the key here), and each model gets its own copy, so nothing a command does to its weights reaches
    another. Processes a command starts (tensor-parallel ranks, the split's workers) draw their own."""
    import torch

    from nano.model import Transformer

    draw, drawn = Transformer.init_random, {}

    def init_random(model: Transformer, seed: int, std: float = 0.02) -> None:
        params = [param for _, param in model.named_parameters()]
        key = (seed, std, tuple((name, tuple(param.shape), param.dtype, param.device)
                                for name, param in model.named_parameters()))
        if key not in drawn:
            draw(model, seed, std)
            drawn[key] = [param.detach().clone() for param in params]
            return
        with torch.no_grad():
            for param, values in zip(params, drawn[key]):
                param.copy_(values)

    Transformer.init_random = init_random
    try:
        yield
    finally:
        Transformer.init_random = draw


def run(example: Example, workdir: Path) -> Run:
    argv, files = list(example.argv), []
    for i, word in enumerate(argv[:-1]):
        if word in OUTPUT_FLAGS or (word == "--json" and _takes_file(argv, "--json")):
            target = argv[i + 1]
            if target.startswith("/tmp/"):
                target = str(workdir / target.removeprefix("/tmp/"))
            argv[i + 1] = target
            files.append(workdir / target)
    code, stdout, stderr, output = run_in_process(argv, "".join(line + "\n" for line in example.stdin), workdir)
    back = lambda text: text.replace(f"{workdir}/", "/tmp/")    # as the doc wrote the paths
    if example.json_mode:
        return Run(argv, code, stdout, back(stderr), files)
    return Run(argv, code, back(output), "", files)


def run_in_process(argv: list[str], stdin: str, workdir: Path) -> tuple[int, str, str, str]:
    """`nano ARGV` in this process as `python -m nano ARGV` runs in `workdir` with COLUMNS=120 and TERM=dumb:
    (exit code, stdout, stderr, both as a terminal shows them). What reaches file descriptors 1 and 2 directly (C
    code, and the processes the command starts: tensor-parallel ranks, the split's workers, which inherit them)
    comes after what Python wrote; warnings show as in a fresh interpreter (its default filters); an exception the
    command does not handle shows as the traceback the interpreter would print. What a command may change in the
    process that runs it is put back: the environment, the working directory, torch's thread count (LLM sets it,
    --threads too) and the random generators' states; the ranks a command starts end with it (cli/main.py)."""
    import random
    import tempfile
    import traceback
    import warnings

    import torch
    from typer.testing import CliRunner

    from nano.cli.main import app

    def show(message, category, filename, lineno, file=None, line=None) -> None:   # as Python's own, to stderr
        sys.stderr.write(warnings.formatwarning(message, category, filename, lineno, line))

    class Unbuffered(CliRunner):
        """Every write reaches the output at once (PYTHONUNBUFFERED=1, as a child process runs): stdout and stderr
        interleave in the order they were written."""
        @contextlib.contextmanager
        def isolation(self, *args, **kwargs):
            with super().isolation(*args, **kwargs) as streams:
                sys.stdout.reconfigure(write_through=True)
                sys.stderr.reconfigure(write_through=True)
                yield streams

    saved = dict(os.environ), os.getcwd(), torch.get_num_threads(), torch.get_rng_state(), random.getstate()
    raw, kept = [tempfile.TemporaryFile() for _ in range(2)], [os.dup(1), os.dup(2)]
    try:
        os.chdir(workdir)
        for fd, file in zip((1, 2), raw):
            os.dup2(file.fileno(), fd)
        with warnings.catch_warnings():
            warnings.resetwarnings()
            for category in (DeprecationWarning, PendingDeprecationWarning, ImportWarning, ResourceWarning):
                warnings.simplefilter("ignore", category)
            warnings.showwarning = show
            result = Unbuffered().invoke(app, argv, input=stdin, prog_name="nano",
                                        env={"COLUMNS": str(COLUMNS), "TERM": "dumb", "FORCE_COLOR": None,
                                             "NO_COLOR": None})
    finally:
        for fd, copy in zip((1, 2), kept):
            os.dup2(copy, fd)
            os.close(copy)
        environ, cwd, threads, torch_rng, python_rng = saved
        os.environ.clear()
        os.environ.update(environ)
        os.chdir(cwd)
        torch.set_num_threads(threads)
        torch.set_rng_state(torch_rng)
        random.setstate(python_rng)
    direct = []
    for file in raw:
        file.seek(0)
        direct.append(file.read().decode(errors="replace"))
        file.close()
    stdout, stderr, output = result.stdout + direct[0], result.stderr + direct[1], result.output + "".join(direct)
    if result.exception is not None and not isinstance(result.exception, SystemExit):
        trace = "".join(traceback.format_exception(result.exception))
        stderr, output = stderr + trace, output + trace
    return result.exit_code, stdout, stderr, output


def problems(example: Example, result: Run) -> list[str]:
    """What is wrong with this run against the doc (empty: it matches)."""
    found = []
    everything = result.output + result.stderr
    if "Traceback (most recent call last)" in everything:
        found.append("the command printed a traceback")
    expects_error = example.expected is not None and any(line.startswith("error: ")
                                                        for line in example.expected)
    if expects_error:
        errors = [line for line in everything.splitlines() if line.startswith("error: ")]
        if result.returncode == 0 or len(errors) != 1:
            found.append(f"the doc shows an error, but the command exited {result.returncode} with "
                         f"{len(errors)} `error:` lines")
    elif result.returncode != 0:
        found.append(f"exit code {result.returncode}")
    for path in result.files:
        if result.returncode == 0 and not (path.is_file() and path.stat().st_size > 0):
            found.append(f"{path.name} was not written")
    if example.json_mode:
        try:
            value = json.loads(result.output)
        except ValueError:
            found.append("stdout is not one JSON value")
        else:
            if example.expected is not None:
                found.extend(json_problems(example.expected, value))
    elif example.expected is not None and not match_lines(example.expected, result.output.split("\n")):
        found.append("the output's shape differs from the doc:\n" + shape_diff(example.expected,
                                                                             result.output.split("\n")))
    return found
