"""The A/B probes' arguments (scripts/probe_gluon_variants.py, probe_one_pass_backward.py, ab_pass_late.py): what
--against and --rounds refuse, and how they say so, before anything is timed."""

from __future__ import annotations

import importlib.util
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SCRIPTS = ROOT / "scripts"


def _script(name: str):
    """scripts/<name>.py imported as a module (scripts/ is no package)."""
    spec = importlib.util.spec_from_file_location(name, SCRIPTS / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


probe = _script("probe_gluon_variants")
KERNELS = ROOT / "flashsys" / "ops" / "attention" / "gluon_kernels.py"


@pytest.mark.parametrize("script", ["probe_gluon_variants.py", "probe_one_pass_backward.py"])
@pytest.mark.parametrize("path", ["/nonexistent/gluon_kernels.py", str(ROOT / "README.md")])
def test_against_refuses_a_path_that_is_not_a_python_file(script, path):
    """Refused by argparse (exit 2) with the argument and the path named, on any machine (no GPU needed)."""
    done = subprocess.run([sys.executable, str(SCRIPTS / script), "--against", path], capture_output=True, text=True,
                          cwd=ROOT, timeout=120)
    assert done.returncode == 2
    assert "--against" in done.stderr and path in done.stderr


@pytest.mark.parametrize("script", ["probe_gluon_variants.py", "probe_one_pass_backward.py", "ab_pass_late.py"])
@pytest.mark.parametrize("rounds", ["0", "-2", "two"])
def test_rounds_refuses_anything_but_a_whole_number_from_one(script, rounds):
    """No rounds would leave no time to take a median of (a StatisticsError after the whole check): refused by
    argparse, exit 2, naming --rounds and the value."""
    done = subprocess.run([sys.executable, str(SCRIPTS / script), f"--rounds={rounds}"], capture_output=True,
                          text=True, cwd=ROOT, timeout=120)
    assert done.returncode == 2
    assert "--rounds" in done.stderr and repr(rounds) in done.stderr


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
    last = re.search(r",\s*(FOLD_DQ: gl.constexpr = False)\):", text)  # the one pass's last parameter
    assert last and text.count(last.group(0)) == 1
    extra = tmp_path / "extra.py"
    extra.write_text(text.replace(last.group(0), f", {last.group(1)}, EXTRA_FLAG: gl.constexpr = False):"))
    with pytest.raises(SystemExit, match=r"--against .*extra\.py: its attention_backward_one_pass takes EXTRA_FLAG"):
        probe._load_kernels(str(extra))
    lacking = tmp_path / "lacking.py"
    lacking.write_text(text.replace(last.group(0), "):"))
    with pytest.raises(SystemExit, match=r"its attention_backward_one_pass lacks FOLD_DQ"):
        probe._load_kernels(str(lacking))


def test_the_choice_probe_prints_each_candidates_rounds_and_a_nested_choice_apart(monkeypatch, capsys):
    """scripts/probe_choice_timings.py: with do_bench standing in (each candidate's time fixed, a different one per
    round), a one-pass choice prints every candidate's three rounds in its own group and what it took; the dQ
    choice made inside the two passes' first run prints its own line first, and its timings are not counted as the
    outer choice's."""
    import torch
    import triton.testing

    from flashsys.ops.attention import flash_gluon

    choice_probe = _script("probe_choice_timings")
    outer = flash_gluon.ChoiceKey(64, torch.bfloat16, True, False, 4096, "one_pass_det")
    inner = flash_gluon.ChoiceKey(64, torch.bfloat16, True, False, 4096, "dq")
    ms = {}  # (which choice, the variant a run launches) -> its time; every round adds 0.01
    calls = []

    def fake_bench(fn, *args, **kwargs):
        launched = fn()
        calls.append(launched)
        return ms[launched] + 0.01 * (calls.count(launched) - 1)

    def run_inner(variant):
        return "inner", variant

    def run_outer(variant):
        if variant.kind == "tl":
            flash_gluon._choose(inner, run_inner)  # as the two passes' first run makes the dQ choice
        return "outer", variant

    for i, variant in enumerate(outer.candidates()):
        ms["outer", variant] = 2.0 - 0.25 * i  # the last candidate fastest
    for i, variant in enumerate(inner.candidates()):
        ms["inner", variant] = 1.0 + 0.1 * i
    monkeypatch.setattr(triton.testing, "do_bench", fake_bench)
    monkeypatch.setattr(flash_gluon, "autotune_enabled", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)  # a CPU build has no CUDA
    monkeypatch.setattr(flash_gluon, "_chosen", {})
    monkeypatch.setattr(flash_gluon, "_choose", flash_gluon._choose)
    choice_probe._logged_choices()
    assert flash_gluon._choose(outer, run_outer) == outer.candidates()[-1]
    lines = capsys.readouterr().out.splitlines()
    assert [line.split(":")[0] for line in lines] == ["CHOICE dq D64 bfloat16 causal=True N<=4096",
                                                      "CHOICE one_pass_det D64 bfloat16 causal=True N<=4096"]
    assert lines[1].split(": ", 1)[1].startswith(outer.label(outer.candidates()[-1]) + ";")
    for variant in outer.candidates():
        rounds = ", ".join(f"{ms['outer', variant] + 0.01 * r:.3f}" for r in range(3))
        assert f"{outer.label(variant)}: {rounds}" in lines[1]


def test_extra_takes_a_variant_with_alternation_and_refuses_more_numbers():
    """--extra KIND,BLOCK_M,BLOCK_N,NBUF,REGS[,STAGES[,ALTERNATE]]: six numbers make an alternating variant; seven
    are refused naming the form."""
    one_pass = _script("probe_one_pass_backward")
    variant = one_pass.variant_spec("one_pass_det,128,128,2,240,2,1")
    assert (variant.stages, variant.alternate) == (2, 1)
    with pytest.raises(Exception, match=r"REGS\[,STAGES\[,ALTERNATE\]\]"):
        one_pass.variant_spec("one_pass_det,128,128,2,240,2,1,1")
    with pytest.raises(Exception, match="ALTERNATE is 0 .* or 1"):
        one_pass.variant_spec("one_pass_det,128,128,2,240,2,2")


def test_launch_shapes_lists_each_kernel_once_with_its_launch_fields(monkeypatch):
    """probe_fwd_bwd_gap --launch: each kernel of a step once, in start order, with the profiler's launch fields it
    has (a memset or a copy is no kernel, and a repeated kernel is listed at its first launch)."""
    gap = _script("probe_fwd_bwd_gap")
    events = [
        {"cat": "kernel", "name": "bprop", "ts": 20, "dur": 5,
         "args": {"grid": [132, 1, 1], "block": [384, 1, 1], "registers per thread": 168, "shared memory": 216064}},
        {"cat": "gpu_memset", "name": "Memset (Device)", "ts": 1, "dur": 1, "args": {}},
        {"cat": "kernel", "name": "fprop", "ts": 10, "dur": 5, "args": {"grid": [132, 1, 1], "blocks per SM": 1.0}},
        {"cat": "kernel", "name": "fprop", "ts": 30, "dur": 5, "args": {"grid": [264, 1, 1]}},
    ]
    monkeypatch.setattr(gap, "trace_events", lambda step, iters: events)
    assert gap.launch_shapes(None) == [
        ("fprop", "grid [132, 1, 1], blocks per SM 1.0"),
        ("bprop", "grid [132, 1, 1], block [384, 1, 1], registers per thread 168, shared memory 216064"),
    ]


def test_same_bits_on_rerun_tells_a_run_that_repeats_its_bits_from_one_that_does_not(monkeypatch):
    """The probes' determinism check (probe_one_pass_backward, ab_pass_late): True only where the rerun writes the
    very bits the first run left."""
    import torch

    one_pass = _script("probe_one_pass_backward")
    monkeypatch.setattr(torch.cuda, "synchronize", lambda: None)
    out = torch.ones(4)
    assert one_pass.same_bits_on_rerun(lambda: out.copy_(torch.ones(4)), out)
    assert not one_pass.same_bits_on_rerun(lambda: out.add_(torch.full((4,), 1e-7)), out)
