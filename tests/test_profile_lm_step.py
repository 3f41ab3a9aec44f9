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


def test_attention_split_takes_every_backends_attention_kernels_and_leaves_the_rest():
    sys.path.insert(0, str(ROOT / "scripts"))
    try:
        from profile_lm_step import attention_split
    finally:
        sys.path.remove(str(ROOT / "scripts"))
    kernels = [("flash_fwd_kernel", 1.0, 12), ("flash_bwd_dkdv_kernel", 1.5, 12), ("attention_forward", 0.5, 2),
               ("one_pass_epilogue_kernel", 0.1, 12),
               ("cudnn_generated_fort_native_sdpa_sm90_flash_fprop_wgmma_f16_knob_7", 0.9, 12),
               ("void pytorch_flash::flash_fwd_kernel<Flash_fwd_kernel_traits>", 0.2, 1),
               ("fmha_cutlassF_bf16", 0.3, 1),
               ("nvjet_sm90_tst_192x128_64x5_1x2_h_bz_coopB_NNT", 2.0, 49),
               ("triton_poi_fused__unsafe_view_mul_silu_silu_backward_view_4", 0.7, 12)]
    attention_ms, rest_ms, attention = attention_split(kernels)
    assert [name for name, _, _ in attention] == [name for name, _, _ in kernels[:7]]
    assert attention_ms == pytest.approx(4.5) and rest_ms == pytest.approx(2.7)
