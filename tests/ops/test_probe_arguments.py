"""The A/B probes' --against (scripts/probe_gluon_variants.py, probe_one_pass_backward.py): what they refuse, and
how they say so, before anything is timed."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SCRIPTS = ROOT / "scripts"
_spec = importlib.util.spec_from_file_location("probe_gluon_variants", SCRIPTS / "probe_gluon_variants.py")
probe = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(probe)
KERNELS = ROOT / "flashsys" / "ops" / "attention" / "gluon_kernels.py"


@pytest.mark.parametrize("script", ["probe_gluon_variants.py", "probe_one_pass_backward.py"])
@pytest.mark.parametrize("path", ["/nonexistent/gluon_kernels.py", str(ROOT / "README.md")])
def test_against_refuses_a_path_that_is_not_a_python_file(script, path):
    """Refused by argparse (exit 2) with the argument and the path named, on any machine (no GPU needed)."""
    done = subprocess.run([sys.executable, str(SCRIPTS / script), "--against", path], capture_output=True, text=True,
                          cwd=ROOT, timeout=120)
    assert done.returncode == 2
    assert "--against" in done.stderr and path in done.stderr


def _gluon_kernels_import() -> bool:
    from flashsys.ops.attention import flash_gluon

    return flash_gluon._kernels() is not None


def test_against_takes_kernels_with_the_librarys_parameters_and_refuses_others(tmp_path):
    """The library's own file loads. A copy whose one-pass kernel takes a parameter the host does not pass, or lacks
    one it does, is refused naming --against, the kernel and the parameter: without the check the first launch
    failed midway through the timings with a KeyError from the host's launch."""
    if not _gluon_kernels_import():
        pytest.skip("needs a Triton with Gluon's Hopper API")
    assert probe._load_kernels(str(KERNELS)).attention_backward_one_pass.arg_names
    text = KERNELS.read_text()
    signature_end = "NSTAGE: gl.constexpr = 1):"
    assert text.count(signature_end) == 1
    extra = tmp_path / "extra.py"
    extra.write_text(text.replace(signature_end, "NSTAGE: gl.constexpr = 1, PAIRED: gl.constexpr = False):"))
    with pytest.raises(SystemExit, match=r"--against .*extra\.py: its attention_backward_one_pass takes PAIRED"):
        probe._load_kernels(str(extra))
    lacking = tmp_path / "lacking.py"
    lacking.write_text(text.replace(", NSTAGE: gl.constexpr = 1):", "):"))
    with pytest.raises(SystemExit, match=r"its attention_backward_one_pass lacks NSTAGE"):
        probe._load_kernels(str(lacking))
