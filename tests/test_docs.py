"""Docs that print what they show: every `nano ...` command in docs/*.md and README.md is run, and its output is
compared by shape with the output block the doc prints under it (tests/doccheck.py says how). A command the
docs show several times runs once and is compared with each. The matcher itself is tested first, on outputs
written out here, so that a check that cannot fail would be caught.
"""
from __future__ import annotations

import re
import shlex
import time
import xml.etree.ElementTree as ET

import pytest

import doccheck
from doccheck import DocFormatError, Example, examples_in, match_lines, problems, shape


# ---- the matcher, on known outputs ---------------------------------------------------------------------------
PAGES = """\
request 0: 90 tokens cached in 2 pages of 64 tokens

 page   physical   tag   tokens   filled
 ─────────────────────────────────────────
    0          0     1     0–63    64/64
    1          1     1    64–89    26/64
""".splitlines()


def test_numbers_spaces_and_rules_do_not_count():
    actual = ["request 3: 107 tokens cached in 2 pages of 64 tokens", "",
              " page     physical   tag   tokens   filled", " ─────────",
              "    0         12     7     0–63    64/64", "    1         13     7   64–106    43/64"]
    assert match_lines(PAGES, actual)
    assert shape(" total tok/s   1,038.4   -5.6%  ±17%  1.37M  0.88×") == "total tok/s # #% #% # #×"
    assert shape("fp8, 64-token pages; glm-5.2 kv-dtype=bf16") == "fp8, #-token pages; glm-# kv-dtype=bf16"


def test_a_table_with_another_row_count_fails():
    """The issue's case: a doc showing two pages where the command's input produces one."""
    one_page = ["request 0: 44 tokens cached in 1 page of 64 tokens", " page   physical   tag   tokens   filled",
                "    0          0     1     0–43    44/64"]
    assert not match_lines(PAGES, one_page)


def test_words_and_verdicts_count():
    assert not match_lines([" prefill tok/s   0.85×   0.88×   yes"], [" prefill tok/s   0.85×   1.02×   no"])
    assert match_lines([" prefill tok/s   0.85×   0.88×   {yes|within noise}"],
                       [" prefill tok/s   0.85×   0.97×   within noise"])
    assert not match_lines([" prefill tok/s   0.85×   0.88×   {yes|within noise}"],
                           [" prefill tok/s   0.85×   1.12×   no"])
    assert not match_lines(["KV pool:    fp8, 64-token pages"], ["KV pool:    bf16, 64-token pages"])


def test_elisions_stand_for_any_lines_and_nothing_else_is_loose():
    actual = ["nano glm-5.2 (random weights)", "\x01garbage", "more garbage", "prompt: 11 tokens, 63.0 tok/s"]
    assert match_lines(["nano glm-5.2 (random weights)", "<the reply: random bytes>", "prompt: 9 tokens, 1 tok/s"],
                       actual)
    assert match_lines(["…", "prompt: 11 tokens, 63.0 tok/s"], actual)
    assert not match_lines(["nano glm-5.2 (random weights)", "prompt: 11 tokens, 63.0 tok/s"], actual)
    assert not match_lines(["…", "prompt: 11 tokens, 63.0 tok/s", "footer"], actual)      # a line the run lacks
    assert match_lines(["nano glm-5.2 (…)", "…"], actual)


def test_the_doc_format_is_read_as_documented(tmp_path):
    doc = tmp_path / "docs" / "page.md"
    doc.parent.mkdir()
    doc.write_text("""\
```bash
nano chat glm-5.2 --seed 1 \\
    --max-tokens 4     # a comment
```

```
nano glm-5.2 (random weights)
>>> hello
<the reply>
```

```bash
nano models
nano bench glm-5.2 --profile-me --output /tmp/out.json
```

```
$ nano fault glm-5.2 --corrupt-page-table --json
{"fault": "corrupt-page-table", …}
```
""")
    chat, models, bench, fault = examples_in(doc)
    assert chat.argv == ["chat", "glm-5.2", "--seed", "1", "--max-tokens", "4"] and chat.stdin == ["hello"]
    assert chat.expected == ["nano glm-5.2 (random weights)", "<the reply>"] and chat.line == 2
    assert models.expected is None and bench.expected is None
    assert fault.json_mode and fault.expected == ['{"fault": "corrupt-page-table", …}']

    doc.write_text("```bash\nnano models\nnano models --capacity\n```\n\n```\nsome output\n```\n")
    with pytest.raises(DocFormatError, match="2 commands"):
        examples_in(doc)
    doc.write_text("```bash\nnano chat glm-5.2\nnano glm-5.2 (random weights)\n```\n")
    with pytest.raises(DocFormatError, match="runs no command"):
        examples_in(doc)
    doc.write_text("Then:\n\n```\n>>> /stats\nKV pool: ...\n```\n")
    with pytest.raises(DocFormatError, match="directly follow"):
        examples_in(doc)


def test_json_output_is_checked_by_keys_and_values():
    example = Example("x.md", 1, "fault glm-5.2 --json", ["fault", "glm-5.2-random", "--json"],
                      expected=['{"fault": "corrupt-transfer", "aborted": {"0": "request 4 (slot 4)"}, …}'])
    run = doccheck.Run(example.argv, 0, '{"model": "glm-5.2-random", "fault": "corrupt-transfer", '
                                        '"aborted": {"3": "request 2 (slot 1)"}}\n', "", [])
    assert problems(example, run) == []
    run.output = '{"fault": "kill-prefill", "aborted": {}}'
    assert problems(example, run) == ["'fault': the doc shows 'corrupt-transfer', the command printed 'kill-prefill'",
                                      "key '0' is not in the output"]
    run.output = 'loading...\n{"fault": "corrupt-transfer"}'
    assert problems(example, run) == ["stdout is not one JSON value"]


def test_errors_must_fail_and_successes_must_not():
    example = Example("x.md", 1, "chat glm-5.2 -p hi", ["chat", "glm-5.2-random", "-p", "hi"],
                      expected=["error: request 0 needs 3 KV pages but the pool holds 1 (16 tokens)"])
    assert problems(example, doccheck.Run([], 1, "error: request 0 needs 3 KV pages but the pool holds 1 (16 "
                                                 "tokens)\n", "", [])) == []
    assert problems(example, doccheck.Run([], 0, "error: request 0 needs 3 KV pages but the pool holds 1 (16 "
                                                 "tokens)\n", "", []))
    assert problems(Example("x.md", 1, "models", ["models"]), doccheck.Run([], 2, "", "", [])) == ["exit code 2"]


def test_weights_drawn_once_are_the_weights_a_fresh_draw_gives():
    """The doc commands' shortcut (doccheck.weights_drawn_once) against init_random itself: the same values for the
    same seed, other values for another, and a copy of its own in each model."""
    import torch

    from fixtures import TINY
    from nano.config import ModelConfig
    from nano.model import Transformer

    config = ModelConfig.from_hf({**TINY, "model_type": "deepseek_v3"})
    runs = [(0, torch.float32), (0, torch.float32), (1, torch.float32), (0, torch.bfloat16)]
    fresh = {run: Transformer(config, run[1]) for run in set(runs)}
    for (seed, _), model in fresh.items():
        model.init_random(seed)
    with doccheck.weights_drawn_once():
        drawn = [Transformer(config, dtype) for _, dtype in runs]
        for model, (seed, _) in zip(drawn, runs):
            model.init_random(seed)
    for model, run in zip(drawn, runs):
        assert all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), fresh[run].state_dict().values()))
    assert not torch.equal(drawn[0].lm_head.weight, drawn[2].lm_head.weight)
    assert drawn[0].lm_head.weight.data_ptr() != drawn[1].lm_head.weight.data_ptr()


# ---- the docs --------------------------------------------------------------------------------------------------
def test_reproduce_blog_table_matches_the_docs():
    """--reproduce-blog is exempt from running here (tests/test_bench.py runs it on the tiny checkpoint at small
    sizes); its table and note, rendered from figures of one of its runs, must still have the shape the docs show."""
    import torch
    from rich.console import Console

    from nano.cli import blog
    from nano.cli.machine import device_name

    measured = {"kv_capacity_ratio": 189 / 96, "bf16_saturation": 32, "fp8_concurrency": 63,   # the tensor layout's
                "kv_peak_throughput_ratio": 1.02, "int4_decode_ratio": 1.33, "int4_prefill_ratio": 0.90,
                "integrity_throughput_cost": 0.0574, "integrity_share_of_step": 0.0006, "integrity_p95_cost": 0.19,
                "run_to_run_noise": {"throughput": 0.35, "p95": 0.74, "kv_throughput": 0.33},
                "paired_ratios": {"int4_decode_ratio": [0.31, 4.99, 1.3], "int4_prefill_ratio": [0.47, 1.37, 0.9],
                                  "kv_peak_throughput_ratio": [1.14, 0.91]},
                "fp8_kv_top1_delta": {"value": -0.0004, "low": -0.0021, "high": 0.0012},
                "int4_top1_delta": {"value": 0.0002, "low": -0.0006, "high": 0.0011}}
    holds = {"kv_peak_throughput_ratio": None, "int4_decode_ratio": True, "int4_prefill_ratio": True,
             "integrity_share_of_step": True, "integrity_throughput_cost": None, "integrity_p95_cost": None,
             "fp8_kv_top1_delta": True, "int4_top1_delta": True}
    accuracy = {"model": "trained nano stand-in of glm-5.2, 10,598,592 parameters, trained on Shakespeare "
                         "(Project Gutenberg; Hamlet and The Tempest held out)"}
    device = device_name(torch.device("cpu"))
    console = Console(width=doccheck.COLUMNS, highlight=False)
    with console.capture() as captured:
        console.print(blog.blog_table(blog.blog_rows(measured, {"fp8": 46.0, "int4": 61.0},
                                                     {"fp8": 1362.0, "int4": 1236.0}, "CPU"), holds, device))
        console.print(blog.blog_note(measured, device, accuracy), markup=False, soft_wrap=True)
    shown = [e for e in doccheck.all_examples() if "--reproduce-blog" in e.argv and e.expected is not None]
    assert shown
    for example in shown:
        assert match_lines(example.expected, captured.get().split("\n")), (
            example.id + "\n" + doccheck.shape_diff(example.expected, captured.get().split("\n")))


def test_kill_prefill_report_matches_the_docs():
    """`nano fault --kill-prefill` is exempt from running here (doccheck.EXEMPT says why); its report, rendered
    from the figures of one of its runs, must still have the shape the docs show, all but the first line (the
    split's label and pids, printed as the workers start)."""
    from nano.cli import fault
    from nano.cli.console import out

    report = {"detail": fault.SPLIT_FAULTS["kill-prefill"],
              "pids": {"prefill": 31618, "decode": 31619, "prefill_after_restart": 31910},
              "aborted": {str(i): "the prefill worker (pid 31618) died with exit code -9" for i in (1, 2, 3)},
              "completed_identical": [0], "silent_wrong": [], "seconds_to_settle": 0.59, "after_restart": "length"}
    with out.capture() as captured:
        fault.print_split_fault(report, identical_after=True)
    shown = [e for e in doccheck.all_examples() if "--kill-prefill" in e.argv and e.expected is not None]
    assert shown
    for example in shown:
        assert match_lines(example.expected[1:], captured.get().split("\n")), (
            example.id + "\n" + doccheck.shape_diff(example.expected[1:], captured.get().split("\n")))


def test_every_doc_follows_the_format():
    for path in doccheck.DOCS:
        examples_in(path)          # raises DocFormatError with the place


def _groups() -> dict[tuple, list[Example]]:
    groups: dict[tuple, list[Example]] = {}
    try:
        examples = doccheck.all_examples()
    except DocFormatError:
        return {}                  # test_every_doc_follows_the_format says where
    for example in examples:
        groups.setdefault((tuple(example.argv), tuple(example.stdin)), []).append(example)
    return groups


GROUPS = _groups()


@pytest.fixture(scope="module")
def weights_drawn_once():
    """The commands draw the same random stand-ins again and again: each is drawn once here (doccheck says why that is
    safe), and the copies are dropped after the last command."""
    with doccheck.weights_drawn_once():
        yield


# `nano fault` breaks the engine's bookkeeping on purpose: run in process, it goes without the suite's check after
# every step (conftest.py), as it does in its own process
@pytest.mark.parametrize("key", [pytest.param(key, marks=[pytest.mark.breaks_invariants] * (key[0][0] == "fault"))
                                 for key in GROUPS], ids=[f"nano {group[0].text}" for group in GROUPS.values()])
def test_doc_command(key, tmp_path, weights_drawn_once):
    group = GROUPS[key]
    reason = doccheck.EXEMPT.get(group[0].text)
    if reason:
        pytest.skip(reason)
    started = time.perf_counter()
    result = doccheck.run(group[0], tmp_path)
    seconds = time.perf_counter() - started
    report = []
    for example in group:
        found = problems(example, result)
        if found:
            report.append(f"{example.id}:\n  " + "\n  ".join(found))
    assert not report, ("\n".join(report) + f"\n--- output ({seconds:.1f} s, exit {result.returncode}) ---\n"
                        + result.output[-6000:] + result.stderr[-3000:])


def test_the_readme_counts_the_tests_the_suite_has(request: pytest.FixtureRequest):
    """README's suite row quotes `.ci/run`'s "N passed, M skipped": together they must be the tests this run of the
    whole suite collected (a count that went stale, as "606 tests" did). A selection (`-k`, a file) collects fewer,
    so there this check does not apply."""
    import re
    from pathlib import Path

    config = request.config
    whole = ([Path(arg).resolve() for arg in config.args] == [doccheck.REPO_ROOT / "tests"]
             and not config.option.keyword and not config.option.markexpr and not config.option.deselect)
    if not whole:
        pytest.skip("only the whole suite knows its count")
    quoted = re.search(r"\.ci/run` on a clean clone[^|]*?: ([\d,]+) passed, ([\d,]+) skipped",
                       (doccheck.REPO_ROOT / "README.md").read_text())
    assert quoted, "README's suite row names no count"
    passed, skipped = (int(group.replace(",", "")) for group in quoted.groups())
    assert passed + skipped == request.session.testscollected


def test_the_stand_ins_parameter_counts_the_docs_quote_are_the_shipped_checkpoints():
    """"trained nano stand-in of glm-5.2, 10,598,592 parameters" and docs/eval.md's table: every count the docs
    quote for a trained stand-in is the sum of its shipped checkpoint's tensor sizes (read from the safetensors
    header, not from nano's own count), less the routers' e_score_correction_bias: a buffer, as in transformers."""
    import math
    import re

    from safetensors import safe_open

    shipped = {}
    for name in ("glm-5.2", "kimi-k2.6"):
        with safe_open(str(doccheck.REPO_ROOT / "nano" / "standins" / name / "model.safetensors"), "pt") as weights:
            shipped[name] = sum(math.prod(weights.get_slice(key).get_shape()) for key in weights.keys()
                                if not key.endswith("e_score_correction_bias"))
    line = r"trained nano stand-in of ([\w.-]+), ([\d,]+) parameters"
    quoted = [(path.name, name, int(count.replace(",", ""))) for path in doccheck.DOCS
              for name, count in re.findall(line, path.read_text())]
    assert {name for _, name, _ in quoted} == set(shipped)
    assert [(doc, name, count) for doc, name, count in quoted if count != shipped[name]] == []
    eval_doc = (doccheck.REPO_ROOT / "docs" / "eval.md").read_text()
    table = re.search(r"\| parameters \| ([\d,]+) \| ([\d,]+) \|", eval_doc)
    assert table and sorted(int(c.replace(",", "")) for c in table.groups()) == sorted(shipped.values())


def test_each_chart_in_the_docs_is_drawn_by_the_command_beside_it():
    """Every image a doc shows is in docs/images and in benchmarks/charts.py, which draws it by the command the doc
    prints last before it (a few lines above); the image is that command's chart: an SVG that names the command's
    model and says how its figures were measured. No image lies there unshown."""
    images = doccheck.REPO_ROOT / "docs" / "images"
    shown: dict[str, tuple[str, int, list[Example]]] = {}
    for path in doccheck.DOCS:
        examples = examples_in(path)
        for number, line in enumerate(path.read_text().splitlines(), 1):
            for name in re.findall(r"\]\(images/([^)]+)\)", line):
                shown[name] = (path.name, number, examples)
    assert set(shown) == set(doccheck.CHARTS) == {image.name for image in images.iterdir()}
    for name, (doc, command) in doccheck.CHARTS.items():
        doc_name, line, examples = shown[name]
        before = [example for example in examples if example.line < line]
        assert doc_name == doc and before and line - before[-1].line <= 12, (name, doc_name, line)
        assert before[-1].text == command.removeprefix("nano ") and command.endswith(f"--plot {name}")
        root = ET.parse(images / name).getroot()
        text = " ".join("".join(node.itertext()) for node in root.iter("{http://www.w3.org/2000/svg}text"))
        assert shlex.split(command)[2] in text and re.search(r"[Mm]easured (here )?on ", text), name
