"""scripts/profile_lm_step.py, the probe of where a TransformerLM training step's time goes: on a CPU (`--device
cpu`) it builds the backends' models side by side, times them in turns and prints the host's operations."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "scripts" / "profile_lm_step.py"


def test_it_times_each_backend_in_turns_and_profiles_the_host_on_a_cpu():
    done = subprocess.run([sys.executable, str(SCRIPT), "--device", "cpu", "--preset", "demo", "--context", "32",
                           "--batch", "2", "--mode", "eager", "--warmup", "1", "--iters", "2", "--rounds", "2",
                           "--top", "3"], capture_output=True, text=True, cwd=ROOT, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    out = done.stdout
    for attention in ("flash", "sdpa"):
        assert f"{attention}: 0 graph breaks while compiling" in out
        assert f"=== {attention}" in out
    rounds = re.findall(r"round (\d): flash ([\d.]+) / ([\d.]+); sdpa ([\d.]+) / ([\d.]+)", out)
    assert [r[0] for r in rounds] == ["0", "1"]
    assert all(float(ms) > 0 for r in rounds for ms in r[1:])
    assert out.count("host ops by own time") == 2
    assert "aten::" in out


@pytest.mark.skipif(torch.cuda.is_available(), reason="on a GPU the script profiles instead")
def test_a_gpu_device_without_a_gpu_is_refused_naming_the_fallback():
    done = subprocess.run([sys.executable, str(SCRIPT), "--preset", "demo"], capture_output=True, text=True, cwd=ROOT,
                          timeout=120)
    assert done.returncode == 2 and "--device cpu" in done.stderr


@pytest.mark.parametrize("bad, option", [(["--preset", "huge"], "--preset"), (["--rounds", "0"], "--rounds"),
                                         (["--attention", "dense"], "--attention")])
def test_bad_options_are_refused_naming_them(bad, option):
    done = subprocess.run([sys.executable, str(SCRIPT), "--device", "cpu", *bad], capture_output=True, text=True,
                          cwd=ROOT, timeout=120)
    assert done.returncode == 2 and f"argument {option}" in done.stderr, done.stderr[-1000:]
