"""The kernels scale and shift each score in one FMA, whatever Triton's default fusion of a multiply and an add: 3.10
is announced to stop fusing by default, and unfused, the Gluon forward's FP32 instructions roughly doubled. Compiled
for sm_90 on this machine (no GPU needed) with TRITON_DEFAULT_FP_FUSION=0: every exponential of a kernel's softmax
takes its argument from one FFMA, so the FFMAs are at least as many as the MUFU.EX2s."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

pytest.importorskip("triton")

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

# The first kernel of a compile group (tests/ops/kernel_compile.py), its FFMA and MUFU.EX2 counts, as JSON.
_FIRST_KERNEL = """
import json, re, sys
from tests.ops.kernel_compile import compiled
label, kernel = next(compiled(sys.argv[1]))
if isinstance(kernel, Exception):
    raise kernel
sass = kernel.asm["sass"]
print(json.dumps({"label": label, "ffma": len(re.findall(r"\\bFFMA\\b", sass)),
                  "ex2": len(re.findall(r"MUFU\\.EX2", sass))}))
"""


def _first_kernel_counts(group: str, fusion: str) -> dict:
    """{label, ffma, ex2} of `group`'s first kernel, compiled in a subprocess with TRITON_DEFAULT_FP_FUSION=fusion."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_DEFAULT_FP_FUSION"] = fusion  # part of a compile's options, so of its cache key too
    r = subprocess.run([sys.executable, "-c", _FIRST_KERNEL, group], capture_output=True, text=True, timeout=600,
                       env=env, cwd=ROOT)
    assert r.returncode == 0, r.stderr[-3000:]
    return json.loads(r.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("group", ["tl", "D 64 forward", "D 64 dq"])
def test_scores_take_one_fma_each_without_default_fusion(group):
    """The `tl` forward, the Gluon forward (its softmax step) and the Gluon dQ kernel (P from S and L)."""
    if group != "tl":
        from flashsys.ops.attention import gluon

        pytest.importorskip("triton.experimental.gluon.language.nvidia.hopper")
        if gluon.kernels() is None:
            pytest.skip("this Triton has no Gluon Hopper API")
    counts = _first_kernel_counts(group, "0")
    assert counts["ex2"] > 0, counts
    assert counts["ffma"] >= counts["ex2"], counts
