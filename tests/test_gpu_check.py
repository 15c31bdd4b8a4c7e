"""benchmarks/gpu.py, the command to run when a GPU is lent, kept working without one.

Its --toy mode runs every section at toy shapes with the kernels in Triton's interpreter. TRITON_INTERPRET must be
set before triton is first imported (see tests/fixtures.py), so the script runs in a child process, with CUDA
hidden so that a GPU machine runs the same thing: once whole, every check must pass and the JSON hold every
section; once with a kernel entry point patched here to return wrong values, which must fail loudly. The patch
lives in this file: the script has no hook for it.
"""
from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).parents[1]
SCRIPT = ROOT / "benchmarks" / "gpu.py"
KERNEL_SECTIONS = ("mla_decode_paged", "w4a16_gemm", "fp8_gemm", "fused_moe")
INTERPRETER = {"TRITON_INTERPRET": "1", "CUDA_VISIBLE_DEVICES": ""}

# Loads the script as a module, makes w4a16_gemm 10% off (five times the bound), and runs its main.
WRONG_W4A16 = """
import importlib.util, sys
spec = importlib.util.spec_from_file_location("gpu_check", sys.argv[1])
gpu = sys.modules["gpu_check"] = importlib.util.module_from_spec(spec)
spec.loader.exec_module(gpu)
right = gpu.kernels.w4a16_gemm
gpu.kernels.w4a16_gemm = lambda *args, **kwargs: right(*args, **kwargs) * 1.1
sys.exit(gpu.main(sys.argv[2:]))
"""


@pytest.fixture(autouse=True)
def needs_triton() -> None:
    pytest.importorskip("triton", reason="triton is not installed")


def run(args: list[str], env: dict[str, str]) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, *args], cwd=ROOT, env={**os.environ, **env}, capture_output=True,
                          text=True, timeout=300)


def test_toy_run_checks_every_kernel_and_writes_every_section(tmp_path: Path) -> None:
    out = tmp_path / "report.json"
    child = run([str(SCRIPT), "--toy", "--output", str(out)], INTERPRETER)
    assert child.returncode == 0, child.stdout[-4000:] + child.stderr[-4000:]
    assert "MISMATCH" not in child.stderr and "FAILED" not in child.stderr
    report = json.loads(out.read_text())
    assert report["passed"] and report["failures"] == []
    assert report["environment"]["interpreter"] and report["mode"] == "toy"
    assert set(report["device_figures"]) == {"copy_bandwidth_bytes_per_s", "peak_bf16_flop_per_s",
                                             "quoted_peak_bf16_flop_per_s"}
    assert all(figure["value"] > 0 and figure["obtained"] for figure in report["device_figures"].values())
    assert set(report["sections"]) == {*KERNEL_SECTIONS, "end_to_end"}

    for name in KERNEL_SECTIONS:
        section = report["sections"][name]
        assert section["status"] == "ran" and "error" not in section and section["rows"], name
        assert section["obtained"]["kernel"].startswith("interpreter: correctness only")
        for row in section["rows"]:
            assert row["kernel"] == name and "error" not in row, row
            check = row["correctness"]
            assert check["passed"] and check["rel_error"] <= check["bound"], row
            assert isinstance(row["times_ms"]["kernel"], float) and row["bytes"] > 0
            assert 0 < row["copy_bandwidth_share"]
    mla = report["sections"]["mla_decode_paged"]["rows"]
    assert {r["shape"]["pages"] for r in mla} == {"bf16", "fp8:token", "fp8:tensor", "fp8:tile"}
    assert {r["shape"]["num_splits"] for r in mla} == {1, 3}
    assert {r["shape"]["format"] for r in report["sections"]["fused_moe"]["rows"]} == {"int4", "fp8"}
    gemm_rows = report["sections"]["w4a16_gemm"]["rows"] + report["sections"]["fp8_gemm"]["rows"]
    assert any(r["peak_flop_share"] for r in gemm_rows)                      # the prefill rows' FLOP share
    for r in report["sections"]["w4a16_gemm"]["rows"]:                         # timed, or why not
        assert isinstance(r["times_ms"]["tinygemm"], float) or r["times_ms"]["tinygemm"].startswith("unavailable")

    e2e = report["sections"]["end_to_end"]
    assert e2e["status"] == "ran" and "PyTorch paths" in e2e["obtained"]
    assert {(r["weights"], r["kv_dtype"]) for r in e2e["rows"]} == {(w, kv) for w in ("bf16", "fp8", "int4")
                                                                  for kv in ("bf16", "fp8")}
    assert all(r["tok_s"] > 0 and r["tpot_ms"] > 0 and not r["triton_kernels"] for r in e2e["rows"])


def test_a_wrong_kernel_fails_loudly(tmp_path: Path) -> None:
    out = tmp_path / "report.json"
    child = run(["-c", WRONG_W4A16, str(SCRIPT), "--toy", "--only", "w4a16_gemm", "--output", str(out)],
                INTERPRETER)
    assert child.returncode == 1, child.stdout[-4000:] + child.stderr[-4000:]
    report = json.loads(out.read_text())                                       # written all the same
    rows = report["sections"]["w4a16_gemm"]["rows"]
    assert rows and not any(r["correctness"]["passed"] for r in rows) and not report["passed"]
    mismatches = [line for line in child.stderr.splitlines() if line.startswith("MISMATCH w4a16_gemm ")]
    assert len(mismatches) == len(rows) and mismatches == report["failures"]
    head, _, verdict = mismatches[0].partition(": max abs error / max abs reference = ")
    error, bound = verdict.split(" > ")
    assert head == "MISMATCH w4a16_gemm gate/up 96x256, M=1" and 0.09 < float(error) < 0.12 and bound == "0.02"
    assert report["sections"]["fused_moe"]["status"] == "skipped (--only)"


@pytest.mark.parametrize("args,interpret,message", [
    ([], None, "error: benchmarks/gpu.py needs a CUDA GPU; without one"),
    (["--toy"], "0", "error: --toy without a GPU"),
])
def test_without_a_gpu_it_says_what_to_run(tmp_path: Path, args: list[str], interpret: str | None, message: str,
                                           monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture) -> None:
    """In this process (the refusal comes before any kernel is imported), with CUDA hidden from torch."""
    spec = importlib.util.spec_from_file_location("gpu_check", SCRIPT)
    gpu = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, "gpu_check", gpu)            # its dataclasses look their module up there
    spec.loader.exec_module(gpu)
    monkeypatch.setattr(gpu.torch.cuda, "is_available", lambda: False)
    if interpret is None:
        monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    else:
        monkeypatch.setenv("TRITON_INTERPRET", interpret)
    assert gpu.main([*args, "--output", str(tmp_path / "r.json")]) == 1
    stderr = capsys.readouterr().err
    assert stderr.strip().splitlines() == [stderr.strip()] and stderr.startswith(message), stderr
    assert not (tmp_path / "r.json").exists()
