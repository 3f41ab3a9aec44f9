"""scripts/ncu_forward.py, the probe that puts forwards side by side under Nsight Compute: its summary reads ncu's CSV
pages back kernel by kernel (checked here on small pages written the way ncu writes them), and `run` checks its
arguments and says what it needs on a machine without a GPU."""

from __future__ import annotations

import csv
import io
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "scripts" / "ncu_forward.py"


def _run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(SCRIPT), *args], check=False, capture_output=True, text=True, cwd=ROOT,
                          timeout=300)


def _details(kernels: dict[str, dict[tuple[str, str], str]]) -> str:
    out = io.StringIO()
    w = csv.writer(out, quoting=csv.QUOTE_ALL)
    w.writerow(["ID", "Kernel Name", "Section Name", "Metric Name", "Metric Unit", "Metric Value"])
    for i, (name, metrics) in enumerate(kernels.items()):
        for (section, metric), value in metrics.items():
            w.writerow([str(i), name, section, metric, "", value])
    return out.getvalue()


def _raw(rows: list[dict[str, str]]) -> str:
    names = sorted({k for row in rows for k in row})
    out = io.StringIO()
    w = csv.writer(out, quoting=csv.QUOTE_ALL)
    w.writerow(names)
    w.writerow(["%"] * len(names))  # ncu's units row
    for row in rows:
        w.writerow([row.get(n, "") for n in names])
    return out.getvalue()


def _source(kernel: str, rows: list[tuple[str, float, float, dict[str, float]]]) -> str:
    reasons = ["stall_barrier", "stall_wait", "stall_short_sb"]
    out = io.StringIO()
    w = csv.writer(out, quoting=csv.QUOTE_ALL)
    out.write(f'"Kernel Name","{kernel}",\n')
    w.writerow(["Address", "Source", "Warp Stall Sampling (All Samples)", "Instructions Executed", *reasons,
                "stall_wait (Not Issued)"])
    for i, (source, samples, executed, stalls) in enumerate(rows):
        w.writerow([f"{i * 16:05x}", source, samples, executed, *(stalls.get(r, 0) for r in reasons), 999])
    return out.getvalue()


def test_summary_reads_each_kernels_counters_and_stalls_and_keeps_idle_warps_apart():
    import importlib

    sys.path.insert(0, str(SCRIPT.parent))
    try:
        ncu_forward = importlib.import_module("ncu_forward")
    finally:
        sys.path.remove(str(SCRIPT.parent))
    counters = {("GPU Speed Of Light Throughput", "Elapsed Cycles"): "1,887,398",
                ("Compute Workload Analysis", "Executed Ipc Active"): "1.96",
                ("Launch Statistics", "Block Size"): "512"}  # not a column: left out
    details = _details({"attention_forward_pingpong": counters,
                        "kernel_cutlass_flash_fwd": {("GPU Speed Of Light Throughput", "Elapsed Cycles"): "1,731,983"}})
    raw = _raw([{"sm__pipe_tensor_op_hmma_cycles_active.avg.pct_of_peak_sustained_active": "56.6",
                 "sm__inst_executed_pipe_xu.avg.pct_of_peak_sustained_active": "58.6"},
                {"sm__pipe_tensor_op_hmma_cycles_active.avg.pct_of_peak_sustained_active": "61.9"}])
    ours = _source("attention_forward_pingpong", [
        ("MUFU.EX2 R1, R1", 30, 1e6, {"stall_wait": 20, "stall_short_sb": 10}),
        ("@!P0 FADD R2, R2, R1", 10, 2e6, {"stall_short_sb": 10}),
        ("NOP", 60, 10, {"stall_barrier": 60}),  # warps done with their part, waiting at the end
    ])
    theirs = _source("kernel_cutlass_flash_fwd", [("MUFU.EX2 R1, R1", 40, 1e6, {"stall_wait": 40})])

    text = ncu_forward.summary(["ours", "FA4"], details, raw, ours + theirs)
    table = [line for line in text.splitlines() if line.startswith(("| ours", "| FA4"))]
    assert table[0].split(" | ")[1:3] == ["1,887,398", ""] and "1.96" in table[0] and "56.6" in table[0]
    assert "58.6" in table[0] and "Block Size" not in text
    assert table[1].split(" | ")[1] == "1,731,983" and "61.9" in table[1]
    assert "ours: stall samples by reason (idle warps at a barrier 60.0% apart)" in text
    assert "wait 20.0%, short_sb 20.0%" in text and "MUFU 30.0% 1.0M, FADD 10.0% 2.0M" in text
    assert "FA4: stall samples by reason (idle warps at a barrier 0.0% apart)" in text and "wait 100.0%" in text

    shares, opcodes, idle = ncu_forward.stalls(ncu_forward.source_sections(ours)[0])
    assert idle == pytest.approx(0.6) and shares["wait"] == pytest.approx(0.2)
    assert [op for op, _, _ in opcodes][:2] == ["NOP", "MUFU"]

    # a kernel count that the labels do not match: the rows are named by kernel instead of mislabelled
    renamed = ncu_forward.summary(["only one label"], details, raw, None)
    assert "| attention_forward_pingpong |" in renamed and "only one label" not in renamed


def test_summary_refuses_a_missing_page(tmp_path):
    labels = tmp_path / "labels.txt"
    labels.write_text("ours\n")
    done = _run("summary", "--labels", str(labels), "--details", str(tmp_path / "none.csv"), "--raw", str(labels))
    assert done.returncode == 2 and "argument --details" in done.stderr and "is not a file" in done.stderr


def test_run_refuses_a_bad_cell_and_needs_the_implementations():
    bad = _run("run", "--impls", "fa4", "--cells", "64:sometimes:16384")
    assert bad.returncode == 2 and "want D:MASK:N" in bad.stderr
    for option in ("--heads", "--tokens"):
        done = _run("run", "--impls", "fa4", option, "0")
        assert done.returncode == 2 and f"argument {option}: 1 or more" in done.stderr
    done = _run("run", "--cells", "64:causal:16384")
    assert done.returncode == 2 and "--impls" in done.stderr


@pytest.mark.skipif(torch.cuda.is_available(), reason="on a GPU the script profiles instead")
def test_run_without_a_gpu_says_so_and_exits_2():
    done = _run("run", "--impls", "fa4")
    assert done.returncode == 2 and "needs a CUDA GPU" in done.stderr
