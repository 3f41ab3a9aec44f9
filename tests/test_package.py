"""The installed package: what flashsys imports is what it declares, and the CPU path works without Triton."""

from __future__ import annotations

import ast
import os
import subprocess
import sys
import tomllib
from pathlib import Path

import flashsys

ROOT = Path(__file__).resolve().parent.parent
# Import name -> distribution name, where they differ.
DIST_NAME = {"yaml": "pyyaml", "flash_attn": "flash-attn-4"}


def _third_party_imports() -> set[str]:
    stdlib = set(sys.stdlib_module_names)
    found = set()
    for path in (ROOT / "flashsys").rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                names = [node.module]
            else:
                continue
            for name in names:
                top = name.split(".")[0]
                if top not in stdlib and top != "flashsys":
                    found.add(DIST_NAME.get(top, top))
    return found


def _declared(extras: bool = False) -> set[str]:
    """The distributions pyproject.toml requires (with `extras`, its optional extras' too)."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    requirements = list(project["dependencies"])
    if extras:
        requirements += [r for group in project.get("optional-dependencies", {}).values() for r in group]
    names = set()
    for req in requirements:
        name = req.split(";")[0]
        for sep in "<>=!~[ ":
            name = name.split(sep)[0]
        names.add(name.strip().lower())
    return names


def test_every_imported_distribution_is_a_dependency():
    """What flashsys imports is a dependency, or an extra's (the transformers integration, the FA4 benchmark
    anchor: imported only where they are used, so `pip install flashsys` alone is enough for `flashsys train`)."""
    missing = _third_party_imports() - _declared(extras=True)
    assert not missing, f"flashsys imports {sorted(missing)} but pyproject.toml does not depend on them"
    code = "import flashsys.cli, flashsys.train, flashsys.integrations.transformers, flashsys.ops.attention.backends"
    blocked = "import sys; sys.modules['transformers'] = sys.modules['flash_attn'] = None; "
    r = subprocess.run([sys.executable, "-c", blocked + code], capture_output=True, text=True, cwd=ROOT)
    assert r.returncode == 0, r.stderr[-2000:]


def test_metadata_files():
    assert (ROOT / "LICENSE").is_file() and "MIT" in (ROOT / "LICENSE").read_text()
    assert (ROOT / "flashsys" / "py.typed").is_file()
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    assert project["license"] == "MIT" and "version" in project["dynamic"]  # one version: flashsys.__version__
    assert flashsys.__version__


def test_cpu_path_works_without_triton():
    """Triton ships for Linux only: the tiled PyTorch op, the model and `flashsys info` must not need it."""
    code = (
        "import sys; sys.modules['triton'] = None\n"
        "import torch\n"
        "from flashsys.nn import TransformerLM\n"
        "from flashsys.ops import flash_attention\n"
        "q = torch.randn(1, 2, 16, 8)\n"
        "assert flash_attention(q, q, q, causal=True).shape == q.shape\n"
        "TransformerLM.from_preset('demo')(torch.randint(0, 256, (1, 8)))\n"
        "try:\n"
        "    from flashsys.ops import FlashAttention2Triton\n"
        "    raise SystemExit('FlashAttention2Triton imported without Triton')\n"
        "except ImportError as e:\n"
        "    assert 'needs Triton' in str(e)\n"
        "from flashsys.cli import main\n"
        "assert main(['info']) == 0\n"
    )
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    assert "flash-triton    unavailable: Triton is not installed" in r.stdout
    assert "hopper kernels off (Triton is not installed)" in r.stdout


def test_info_into_a_closed_pipe_ends_quietly():
    """`flashsys info | head -1`: once the reader has gone, the command stops with the shell's SIGPIPE status and no
    traceback (the reader here is gone before the first line, so every run meets the closed pipe)."""
    read_end, write_end = os.pipe()
    os.close(read_end)
    try:
        r = subprocess.run([sys.executable, "-m", "flashsys", "info"], stdout=write_end, stderr=subprocess.PIPE,
                           text=True, timeout=120, cwd=ROOT, check=False)
    finally:
        os.close(write_end)
    assert r.returncode == 141, r.stderr[-2000:]
    assert r.stderr == ""


def test_info_says_whether_the_hopper_kernels_run_and_from_which_size():
    """`flashsys info` ends with the dispatch's own line on the Gluon kernels: off and why on this machine, or on
    with the size bars from which they take a call."""
    import torch

    r = subprocess.run([sys.executable, "-m", "flashsys", "info"], capture_output=True, text=True, timeout=120,
                       cwd=ROOT, check=False)
    assert r.returncode == 0, r.stderr[-2000:]
    last = r.stdout.splitlines()[-1]
    if not torch.cuda.is_available():
        assert last == "hopper kernels off (not an sm_90 GPU)"
    else:
        assert last.startswith("hopper kernels ") and ("2^" in last or "off (" in last)


def test_info_names_a_misset_switch_instead_of_failing():
    """`flashsys info` is where a user looks when attention fails: a FLASHSYS_GLUON or FLASHSYS_TRITON_AUTOTUNE that
    is neither 0 nor 1 (which makes the Triton attention op raise) is reported on its line, and the command still
    succeeds."""
    for switch in ("FLASHSYS_GLUON", "FLASHSYS_TRITON_AUTOTUNE"):  # read on a call, read on import
        env = dict(os.environ, **{switch: "maybe"})
        r = subprocess.run([sys.executable, "-m", "flashsys", "info"], capture_output=True, text=True, timeout=120,
                           cwd=ROOT, env=env, check=False)
        assert r.returncode == 0, r.stderr[-2000:]
        last = r.stdout.splitlines()[-1]
        assert last == f"hopper kernels misconfigured: {switch}='maybe': set it to 0 (off) or 1 (on)"
