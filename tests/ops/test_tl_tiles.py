"""scripts/tl_tiles.py, the GPU probe that times every tile of the `tl` kernels at one shape: each tile's launch is the
one `launch.run` would make (same arguments, the grid its meta-parameters give) and writes what the kernel writes,
checked against float64 math; a run on this CPU (the interpreter: its times say nothing) prints a row per candidate
and per extra tile, names a tile that cannot run, and marks the autotuner's pick; what its arguments refuse."""

from __future__ import annotations

import csv
import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from flashsys.ops.attention.triton.configs import tiles_for

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "scripts" / "tl_tiles.py"
_spec = importlib.util.spec_from_file_location("tl_tiles", SCRIPT)
tl_tiles = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(tl_tiles)
DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
DTYPE = torch.bfloat16 if torch.cuda.is_available() else torch.float16  # the interpreter computes bf16 wrongly
# fp16's error bound at these shapes, scaled by the dtype's precision: bf16 keeps 3 mantissa bits fewer
TOLERANCE = 4e-3 * torch.finfo(DTYPE).eps / torch.finfo(torch.float16).eps


def _run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(SCRIPT), *args], capture_output=True, text=True, cwd=ROOT, timeout=600)


@pytest.mark.parametrize("window", [(-1, 0), (-1, -1), (8, 0)], ids=["causal", "full", "window"])
def test_each_tile_writes_what_its_kernel_writes_within_low_precision_error(window):
    """Grouped-query heads, a length that is no multiple of any tile, and tiles unlike the first candidate's (the
    grid follows each tile's BLOCK_M or BLOCK_N): every kernel's output within low-precision error of float64 math."""
    cell = tl_tiles.Cell(1, 4, 2, 40, 32, DTYPE, window, DEVICE, seed=3)
    for kernel in tl_tiles.KERNELS:
        for tile in (tiles_for(kernel, 64, False, False)[0], (16, 32, 4, 2), (32, 16, 4, 2)):
            error = cell.checked(kernel, tile)
            assert error < TOLERANCE, (kernel, tile, error)


def test_an_output_a_tile_left_unwritten_reads_as_nan_not_as_an_earlier_tiles():
    cell = tl_tiles.Cell(1, 2, 2, 24, 16, DTYPE, (-1, 0), DEVICE)
    assert cell.checked("dkdv", (16, 16, 4, 2)) < TOLERANCE
    cell.outputs["dv"].fill_(float("nan"))  # what `checked` does before a launch that here never comes
    assert cell.error("dkdv") != cell.error("dkdv")  # NaN
    assert cell.error("dq") < TOLERANCE  # the other kernels' outputs are untouched


def test_a_tile_that_cannot_run_leaves_the_outputs_later_kernels_read():
    cell = tl_tiles.Cell(1, 2, 2, 24, 16, DTYPE, (-1, 0), DEVICE)
    before = cell.outputs["o"].clone()
    with pytest.raises(Exception, match="power of 2"):  # Triton's error type differs between interpreter and GPU
        cell.checked("fwd", (48, 16, 4, 2))  # not a power of two
    assert torch.equal(cell.outputs["o"], before)
    assert cell.checked("dq", (16, 16, 4, 2)) < TOLERANCE  # dQ still reads the forward's O and L


def test_a_run_prints_a_row_per_tile_marks_the_autotuners_pick_and_names_a_tile_that_cannot_run():
    done = _run("--batch", "1", "--heads", "2", "--seq-len", "24", "--head-dim", "16", "--dtype",
                "fp32", "--rounds", "1", "--kernels", "fwd", "dkdv",
                "--extra", "fwd:16,16,4,1", "dkdv:48,16,4,2", "dq:16,16,4,1")
    assert done.returncode == 0, done.stderr[-2000:]
    out = done.stdout
    assert "dkdv 48x16, 4 warps, 2 stages: failed" in out  # not a power of two
    for kernel, n_rows in (("fwd", len(tiles_for("fwd", 64, True, False)) + 1),
                           ("dkdv", len(tiles_for("dkdv", 64, True, False)))):
        table = out.split(f"| {kernel} tile")[1].split("\n\n")[0].splitlines()[2:]
        assert len(table) == n_rows, table
        assert sum("(autotuner's pick)" in row for row in table) == 1
        assert all(float(row.split(" | ")[3]) < 1e-4 for row in table), table  # fp32: its error column
        compiled = [row.split(" | ")[5].rstrip(" |") for row in table]  # registers / spills / shared
        assert all(c == "—" for c in compiled) if DEVICE.type == "cpu" else all(c.endswith("KiB") for c in compiled)
    assert "| dq tile" not in out  # --extra of a kernel not asked for times nothing


@pytest.mark.parametrize("l2, suffix", [("flushed", ""), ("warm", "_warm_l2"), ("both", "_flushed_and_warm_l2")])
def test_out_writes_the_printed_rows_with_device_versions_and_command(tmp_path, l2, suffix):
    done = _run("--batch", "1", "--heads", "2", "--seq-len", "24", "--head-dim", "16", "--dtype", "fp32",
                "--rounds", "1", "--kernels", "dkdv", "--l2", l2, "--out", str(tmp_path))
    assert done.returncode == 0, done.stderr[-2000:]
    name = ("tl_tiles_gpu" if torch.cuda.is_available() else "tl_tiles_cpu") + suffix
    assert [p.name for p in tmp_path.glob("*.md")] == [f"{name}.md"]  # the two timings never overwrite each other
    md = (tmp_path / f"{name}.md").read_text()
    for key in ("- device:", "- torch:", "- triton:", "- date:", "- command: `python", "- shape: batch 1, 2 query"):
        assert key in md, key
    with open(tmp_path / f"{name}.csv", newline="") as f:
        rows = list(csv.DictReader(f))
    printed = done.stdout.split("| dkdv tile")[1].split("\n\n")[0].splitlines()[2:]
    assert len(rows) == len(printed) == len(tiles_for("dkdv", 64, True, False))
    assert [r["ms"] for r in rows] == [row.split(" | ")[1] for row in printed]
    assert sum(r["autotuner_pick"] == "True" for r in rows) == 1
    if l2 == "both":  # each row: the flushed time, then the warm time of the same rounds and their ratio
        assert [r["warm_ms"] for r in rows] == [row.split(" | ")[3] for row in printed]
        for r in rows:  # the ratio of the unrounded times: off from the printed 4-decimal times' by their rounding
            warm, flushed = float(r["warm_ms"]), float(r["ms"])
            rounding = warm / flushed * (5e-5 / warm + 5e-5 / flushed) + 5e-4
            assert float(r["warm_x_flushed"]) == pytest.approx(warm / flushed, abs=rounding)
        assert "warm ms | warm / flushed" in done.stdout
    else:
        assert "warm_ms" not in rows[0] and "warm ms" not in done.stdout


@pytest.mark.parametrize("args, message", [
    (("--extra", "fwd:128,64,4"), "want KERNEL:BLOCK_M,BLOCK_N,WARPS,STAGES"),
    (("--extra", "bwd:128,64,4,3"), "want KERNEL:BLOCK_M,BLOCK_N,WARPS,STAGES"),
    (("--mask", "sliding"), "want causal, full or window:LEFT"),
    (("--heads", "12", "--kv-heads", "5"), "divisor of --heads (12)"),
    (("--seq-len", "0"), "argument --seq-len: must be 1 or more"),
    (("--rounds", "0"), "argument --rounds"),
    (("--out", "README.md"), "argument --out: README.md is a file, not a directory"),
    (("--l2", "cold"), "argument --l2: invalid choice"),
])
def test_bad_arguments_are_refused_naming_the_option(args, message):
    done = _run(*args)
    assert done.returncode == 2 and message in done.stderr, done.stderr[-2000:]


@pytest.mark.skipif(torch.cuda.is_available(), reason="a GPU computes bf16")
def test_bf16_on_a_cpu_is_refused_since_the_interpreter_computes_it_wrongly():
    done = _run("--seq-len", "16", "--batch", "1", "--heads", "1")
    assert done.returncode == 2 and "interpreter computes bf16 wrongly" in done.stderr


def test_what_a_tile_compiled_to_reads_from_the_compiled_kernel():
    """Triton's CompiledKernel (after a launch on a GPU) carries n_regs, n_spills and metadata.shared; the
    interpreter returns no compiled kernel."""
    from types import SimpleNamespace

    compiled = SimpleNamespace(n_regs=128, n_spills=0, metadata=SimpleNamespace(shared=57344))
    assert tl_tiles._resources(compiled) == "128 / 0 / 56 KiB"
    assert tl_tiles._resources(None) == "—"
