"""scripts/forward_variants.py, the GPU probe that times every Gluon forward variant beside cuDNN and FA4: on a
machine without a GPU it says what it needs and exits 2 (it times nothing there), and its options parse."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "scripts" / "forward_variants.py"


def _run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(SCRIPT), *args], capture_output=True, text=True, cwd=ROOT, timeout=300)


def test_help_lists_the_cells_options():
    done = _run("--help")
    assert done.returncode == 0, done.stderr[-2000:]
    for option in ("--head-dims", "--seq-lens", "--causal", "--batch", "--heads", "--kv-heads", "--rounds"):
        assert option in done.stdout


@pytest.mark.skipif(torch.cuda.is_available(), reason="on a GPU the script times cells instead")
def test_without_a_gpu_it_says_so_and_exits_2():
    done = _run("--head-dims", "64", "--seq-lens", "1024")
    assert done.returncode == 2
    assert "needs a CUDA GPU" in done.stderr


def test_a_bad_mask_choice_is_refused():
    done = _run("--causal", "sometimes")
    assert done.returncode == 2 and "invalid choice" in done.stderr


def test_layouts_are_the_models_and_dense_ones_only():
    """Both layouts parse (the script then needs its GPU, as any run); a layout it cannot build is refused."""
    assert "--layouts {bnhd,bhnd}" in _run("--help").stdout
    if not torch.cuda.is_available():
        done = _run("--layouts", "bnhd", "bhnd", "--head-dims", "64", "--seq-lens", "1024")
        assert done.returncode == 2 and "needs a CUDA GPU" in done.stderr
    done = _run("--layouts", "bshd")
    assert done.returncode == 2 and "argument --layouts: invalid choice" in done.stderr


def test_no_rounds_is_refused_naming_the_option():
    done = _run("--rounds", "0")
    assert done.returncode == 2 and "argument --rounds" in done.stderr


@pytest.mark.parametrize("kv_heads", ["3", "0"])
def test_kv_heads_that_do_not_divide_the_heads_are_refused(kv_heads):
    done = _run("--heads", "32", "--kv-heads", kv_heads)
    assert done.returncode == 2 and "argument --kv-heads" in done.stderr and "divisor of --heads (32)" in done.stderr


def test_timing_is_the_gpu_work_alone_unless_asked_for_calls():
    """At a model's cell sizes an eager call's host path outlasts its kernels, so the probe times the GPU work alone
    by default, as the dispatch's timed choice does (L2 flushed); `--timing warm` leaves the inputs in L2, as a
    model's projection does; `--timing call` keeps the host-inclusive `do_bench`."""
    sys.path.insert(0, str(SCRIPT.parent))
    try:
        import forward_variants
    finally:
        sys.path.remove(str(SCRIPT.parent))
    from benchmarks.harness import bench_ms, warm_l2_ms
    from flashsys.ops.attention.timed_choice import gpu_ms

    assert forward_variants.TIMERS == {"gpu": gpu_ms, "warm": warm_l2_ms, "call": bench_ms}
    done = _run("--help")
    assert "--timing {gpu,warm,call}" in done.stdout
    assert "gpu: GPU work alone, L2 flushed (default)" in " ".join(done.stdout.split())
    assert _run("--timing", "wall").returncode == 2
