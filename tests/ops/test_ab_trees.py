"""scripts/ab_trees.py, the A/B of two source trees in worker processes: a run on this CPU (the times say nothing
here; the rows, the digests and each worker's own tree are the point), what its arguments refuse, the guard that a
worker imported its own tree's flashsys, and the table's verdict on the trees' bits."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "scripts" / "ab_trees.py"
_spec = importlib.util.spec_from_file_location("ab_trees", SCRIPT)
ab_trees = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(ab_trees)


def _run(*args: str, cwd: Path = ROOT) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(SCRIPT), *args], capture_output=True, text=True, cwd=cwd, timeout=600)


def test_two_trees_are_timed_cell_by_cell_and_their_bits_compared(tmp_path):
    """The same tree twice (a copy would do as well): a row per cell with both trees' medians, their ratio, and the
    gradients' digests equal; the legend names each tree, and each worker says which flashsys it imported."""
    done = _run("--trees", str(ROOT), str(ROOT), "--cells", "32:causal:128", "16:full:64", "--rounds", "2",
                "--tokens", "128", "--heads", "2", "--what", "fwd_bwd", "--impl", "flash-torch")
    assert done.returncode == 0, done.stderr[-2000:]
    out = done.stdout
    assert out.count(f"flashsys {ROOT / 'flashsys' / '__init__.py'}") == 2
    assert f"tree 0: {ROOT}" in out and f"tree 1: {ROOT}" in out
    rows = [line for line in out.splitlines() if line.startswith("| D ")]
    assert [row.split(" | ")[0] for row in rows] == ["| D 32 causal N 128", "| D 16 full N 64"]
    assert all(row.endswith("| yes |") for row in rows)


def test_the_forward_alone_is_timed_and_each_row_is_shown_as_it_is_timed(tmp_path):
    """`--what fwd` times the forward without building a backward (its digest is the output's, the same in both
    copies of the tree); each cell's row goes to stderr as soon as it is timed, so a call cut short keeps its rows,
    while the table on stdout lists each cell once. `--out` writes that table as Markdown and CSV under the device,
    versions, command, each tree's commit and its kernel choices."""
    done = _run("--trees", str(ROOT), str(ROOT), "--cells", "16:causal:64", "--rounds", "1", "--tokens", "64",
                "--heads", "1", "--what", "fwd", "--impl", "flash-torch", "--out", str(tmp_path), "--name", "fwd")
    assert done.returncode == 0, done.stderr[-2000:]
    rows = [line for line in done.stdout.splitlines() if line.startswith("| D ")]
    assert len(rows) == 1 and rows[0].startswith("| D 16 causal N 64") and rows[0].endswith("| yes |")
    assert f"# {rows[0]}" in done.stderr.splitlines()
    md = (tmp_path / "fwd.md").read_text()
    assert rows[0] in md.splitlines() and "| cell | tree 0 ms | tree 1 ms | tree 1 / tree 0 | same bits |" in md
    import torch

    revision = ab_trees.tree_revision(ROOT)
    assert f"- tree 0: {ROOT} ({revision})" in md and f"- tree 1: {ROOT} ({revision})" in md
    # each tree's kernel choices as its dispatch words them (on a CPU: why the Gluon kernels are off)
    chosen = [line for line in md.splitlines() if line.startswith("- tree 0's kernels: ")]
    assert len(chosen) == 1 and "- tree 1's kernels: " in md and "tree 0's kernels: " in done.stderr
    if not torch.cuda.is_available():
        assert chosen[0] == "- tree 0's kernels: off (not an sm_90 GPU)"
    device = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"  # the workers' own
    assert f"- torch: {torch.__version__}" in md and f"- device: {device}\n" in md and "--what fwd" in md
    csv_lines = (tmp_path / "fwd.csv").read_text().splitlines()
    assert csv_lines[0] == "cell,tree 0 ms,tree 1 ms,tree 1 / tree 0,same bits" and len(csv_lines) == 2


def test_a_tree_outside_git_or_with_changes_says_so(tmp_path):
    """The header's commit of each tree: the commit, marked where tracked files differ from it; a folder outside
    any checkout, or a plain folder inside one, says that instead of failing or naming the enclosing commit."""
    assert ab_trees.tree_revision(tmp_path) == "not a git checkout"
    subprocess.run(["git", "init", "-q", str(tmp_path)], check=True)
    (tmp_path / "a.txt").write_text("one\n")
    git = ["git", "-C", str(tmp_path), "-c", "user.name=t", "-c", "user.email=t@t"]
    subprocess.run([*git, "add", "a.txt"], check=True)
    subprocess.run([*git, "commit", "-qm", "a"], check=True)
    clean = ab_trees.tree_revision(tmp_path)
    assert len(clean) == 12 and "+" not in clean
    (tmp_path / "a.txt").write_text("two\n")
    assert ab_trees.tree_revision(tmp_path) == clean + " + uncommitted changes"
    copy = tmp_path / "copy"  # a tree exported into a folder of another checkout is not that checkout's commit
    copy.mkdir()
    assert ab_trees.tree_revision(copy) == f"not a git checkout (a folder inside the checkout at {tmp_path.resolve()})"


def test_a_worker_that_imports_another_trees_flashsys_is_refused(tmp_path):
    """A tree whose `import flashsys` resolves elsewhere (here a package that says it lives in another folder) would
    time the wrong code: the driver stops and names both paths."""
    fake = tmp_path / "tree" / "flashsys"
    fake.mkdir(parents=True)
    (fake / "__init__.py").write_text("__file__ = '/somewhere/else/flashsys/__init__.py'\n")
    (fake / "ops.py").write_text("def flash_attention(*args, **kwargs):\n    raise AssertionError('not timed')\n")
    done = _run("--trees", str(ROOT), str(tmp_path / "tree"), "--cells", "16:full:64", "--rounds", "1",
                "--tokens", "64", "--heads", "1")
    assert done.returncode != 0
    assert "imported flashsys from /somewhere/else/flashsys/__init__.py, not from that tree" in done.stderr


def test_the_arguments_are_refused_by_name(tmp_path):
    """A folder with no flashsys package, a cell that is not D:MASK:N, one tree alone, no rounds, no heads, a run label
    with no table to name it in (--run without --out) or for a table of one run: argparse's exit 2, naming the
    argument, before any worker starts."""
    (tmp_path / "one.md").write_text("# a table written without --run\n")
    for args, words in (((str(ROOT), str(tmp_path)), "no flashsys package there"),
                        ((str(ROOT), str(ROOT), "--cells", "32:dense:128"), "want D:MASK:N"),
                        ((str(ROOT),), "give two or more source trees"),
                        ((str(ROOT), str(ROOT), "--rounds", "0"), "argument --rounds"),
                        ((str(ROOT), str(ROOT), "--heads", "0"), "--heads: 1 or more"),
                        ((str(ROOT), str(ROOT), "--out", str(tmp_path), "--name", "a/b"), "--name 'a/b'"),
                        ((str(ROOT), str(ROOT), "--run", "A"), "--run names this run in --out's table"),
                        ((str(ROOT), str(ROOT), "--out", str(tmp_path), "--name", "one", "--run", "A"),
                         "holds a table of one run")):
        done = _run("--trees", *args)
        assert done.returncode == 2 and words in done.stderr, done.stderr


def test_a_backend_the_registry_lacks_is_named():
    """--impl is looked up in each tree's own registry: a name it lacks stops the run, naming --impl and the
    backends that tree has."""
    done = _run("--trees", str(ROOT), str(ROOT), "--cells", "16:full:64", "--rounds", "1", "--tokens", "64",
                "--heads", "1", "--impl", "flash-cuda")
    assert done.returncode != 0
    assert "--impl 'flash-cuda': no such backend in this tree's registry" in done.stderr
    assert "flash-torch" in done.stderr and "and the sweep's flash-triton-nondet" in done.stderr


def test_the_digest_takes_bfloat16_and_tells_one_bit():
    """The GPU cells run in bfloat16, which numpy lacks: the digest reads any dtype's bytes, and a gradient one bit
    away from another digests differently."""
    import torch

    grads = [torch.randn(2, 3, 8, generator=torch.Generator().manual_seed(5)).to(dtype)
             for dtype in (torch.bfloat16, torch.float16, torch.float32)]
    flipped = [g.clone() for g in grads]
    flipped[0].view(torch.int16)[1, 2, 3] ^= 1
    assert ab_trees._digest(grads) == ab_trees._digest([g.clone() for g in grads])
    assert ab_trees._digest(grads) != ab_trees._digest(flipped)


def test_the_table_says_no_where_the_trees_bits_differ():
    """Digests that differ between trees read "no"; ratios are each tree's median over tree 0's (and over the
    baseline's where it ran)."""
    cell = ab_trees.Cell(128, False, 4096)
    results = [{"cell": cell, "times": {"tree 0": [2.0, 4.0, 3.0], "tree 1": [1.5, 1.5, 1.5], "sdpa-cudnn": [2.0]},
                "digests": {"tree 0": "a", "tree 1": "b"}}]
    text = ab_trees.table(results, [Path("/a"), Path("/b")])
    assert "| D 128 full N 4096 | 3.000 | 1.500 | 0.500 | 2.000 | 1.500 | 0.750 | no |" in text
    assert text.startswith("tree 0: /a\ntree 1: /b")


def test_a_models_training_step_is_timed_tree_against_tree_beside_sdpa():
    """`--what step`: each tree builds the preset's model as its `benchmarks.end_to_end` does and times rounds of
    whole steps; the baseline is the same model with SDPA's attention; the steps' bits are not compared."""
    done = _run("--trees", str(ROOT), str(ROOT), "--what", "step", "--steps", "tiny:32", "--rounds", "2",
                "--impl", "flash-torch", "--step-mode", "eager", "--iters", "1", "--warmup", "0", "--baseline")
    assert done.returncode == 0, done.stderr[-2000:]
    assert "| cell | tree 0 ms | tree 1 ms | tree 1 / tree 0 | sdpa ms | tree 0 / SDPA | tree 1 / SDPA | same bits |" \
        in done.stdout
    row = next(line for line in done.stdout.splitlines() if line.startswith("| tiny step, context 32 |"))
    assert row.endswith("| — |") and len(row.split(" | ")) == 8


def test_every_worker_builds_its_step_models_before_any_is_waited_for(monkeypatch):
    """A step cell's models are compiled in all workers at once (the baseline's too, in the first worker), and only
    then timed, each round's workers in turns, in `round_order`'s order (the baseline's place too): compiling one
    tree's models after another's cost most of a call."""
    log = []

    class FakeWorker:
        def __init__(self, tree, tokens, heads):
            self.tree, self.hello, self.pending = tree, {"flashsys": "", "torch": "", "device": "cuda"}, []

        def send(self, **request):
            log.append(("send", self.tree, request["impl"], bool(request.get("prepare"))))
            self.pending.append(request)

        def receive(self):
            request = self.pending.pop(0)
            log.append(("receive", self.tree, request["impl"], bool(request.get("prepare"))))
            return {"ready": True} if request.get("prepare") else {"ms": 1.0, "digest": None}

        def ask(self, **request):
            if request.get("choices"):
                return {"choices": f"{self.tree}'s kernels"}
            self.send(**request)
            return self.receive()

        def close(self):
            pass

    monkeypatch.setattr(ab_trees, "Worker", FakeWorker)
    trees = [Path("a"), Path("b"), Path("c")]
    done = ab_trees.run(trees, [ab_trees.StepCell("small", 2048)], 2, "flash-triton", "step", True, 16384, 16,
                        dict(mode="compiled", iters=1, warmup=0, batch=4))
    assert done.choices == [f"{tree}'s kernels" for tree in trees]  # asked of every worker after the rounds
    prepared = [entry for entry in log if entry[3]]
    assert [e[0] for e in prepared] == ["send"] * 4 + ["receive"] * 4
    assert {(e[1], e[2]) for e in prepared} == {(t, "flash-triton") for t in trees} | {(trees[0], "sdpa")}
    assert log.index(prepared[-1]) < min(i for i, e in enumerate(log) if not e[3])  # every build before a round
    timed = [(e[1], e[2]) for e in log if e[0] == "receive" and not e[3]]
    assert timed == [(trees[0], "flash-triton"), (trees[1], "flash-triton"), (trees[2], "flash-triton"),
                     (trees[0], "sdpa"), (trees[1], "flash-triton"), (trees[0], "sdpa"), (trees[0], "flash-triton"),
                     (trees[2], "flash-triton")]


def test_a_step_cell_may_give_the_model_other_heads():
    """PRESET:CONTEXT:HEADS times the preset with that many heads (tiny: 4 of D 64, here 2 of D 128), as a preset of
    the worker's own, so that a tree whose `Model` takes only a preset's name builds it too; a head count the model
    cannot take is named."""
    from flashsys.nn import PRESETS

    assert ab_trees.step_spec("tiny:32:2") == ab_trees.StepCell("tiny", 32, 2)
    assert ab_trees.step_spec("tiny:32") == ab_trees.StepCell("tiny", 32, 0)
    assert ab_trees.StepCell("small", 2048, 6).label() == "small with 6 heads step, context 2048"
    saved = dict(PRESETS)  # the presets the worker adds go with the test
    request = dict(step=["tiny", 32, 2], impl="flash-torch", mode="eager", iters=1, warmup=0, batch=1)
    models = {}
    model = ab_trees._step_model(request, models)
    try:
        assert model.model.config.num_heads == 2 and model.model.config.head_dim == 128
        assert ab_trees._step_model(dict(request, step=["tiny", 32, 0]), {}).model.config.num_heads == 4
        with pytest.raises(ab_trees.StepCellError, match="tiny:32:3.*num_heads"):
            ab_trees._step_model(dict(request, step=["tiny", 32, 3]), {})
        with pytest.raises(ab_trees.StepCellError, match="no such preset"):
            ab_trees._step_model(dict(request, step=["huge", 32, 0]), {})
    finally:
        PRESETS.clear()
        PRESETS.update(saved)


def test_step_arguments_are_refused_by_name():
    """--steps without --what step and the reverse, a step cell that is not PRESET:CONTEXT (argparse's exit 2), and
    a preset the tree lacks (the run stops naming it and the presets there)."""
    for args, words in ((("--steps", "tiny:32"), "--steps goes with --what step"),
                        (("--what", "step"), "--what step needs --steps"),
                        (("--what", "step", "--steps", "tiny"), "want PRESET:CONTEXT"),
                        (("--what", "step", "--steps", "tiny:32:0"), "want PRESET:CONTEXT"),
                        (("--what", "step", "--steps", "tiny:32:2:1"), "want PRESET:CONTEXT"),
                        (("--what", "step", "--steps", "tiny:32", "--batch", "0"), "--batch: 1 or more")):
        done = _run("--trees", str(ROOT), str(ROOT), *args)
        assert done.returncode == 2 and words in done.stderr, done.stderr
    done = _run("--trees", str(ROOT), str(ROOT), "--what", "step", "--steps", "huge:32", "--rounds", "1",
                "--impl", "flash-torch", "--step-mode", "eager")
    assert done.returncode != 0 and "--steps huge:32: no such preset in this tree" in done.stderr
    assert "tiny" in done.stderr


def test_cells_are_timed_as_eager_calls_or_as_gpu_work_alone(tmp_path):
    """`--timing call` (the default) times each tree's eager call with its host path; `--timing gpu` its GPU work
    alone, as the dispatch's timed choice does, from the worker's own tree. The table's note says which. The GPU
    timing is refused on a CPU, and for step cells (a step is timed as a training loop runs it)."""
    from benchmarks.harness import bench_ms
    from flashsys.ops.attention.timed_choice import gpu_ms

    assert ab_trees.cell_timer("call") is bench_ms and ab_trees.cell_timer("gpu") is gpu_ms
    done = _run("--trees", str(ROOT), str(ROOT), "--cells", "16:causal:64", "--rounds", "1", "--tokens", "64",
                "--heads", "1", "--what", "fwd", "--impl", "flash-torch", "--out", str(tmp_path), "--name", "t")
    assert done.returncode == 0, done.stderr[-2000:]
    note = "(each timing `do_bench`'s median of the eager call, its host path included)"
    assert note in (tmp_path / "t.md").read_text()
    done = _run("--trees", str(ROOT), str(ROOT), "--what", "step", "--steps", "demo:32", "--timing", "gpu")
    assert done.returncode == 2 and "--timing times attention cells" in done.stderr
    import torch

    if not torch.cuda.is_available():
        done = _run("--trees", str(ROOT), str(ROOT), "--cells", "16:causal:64", "--rounds", "1", "--tokens", "64",
                    "--heads", "1", "--impl", "flash-torch", "--timing", "gpu")
        assert done.returncode != 0 and "--timing gpu times GPU work: it needs a GPU" in done.stderr


def test_inputs_are_laid_out_dense_or_as_a_models_projections_leave_them(tmp_path):
    """`--layout bnhd` gives each tree the FA4 sweep's inputs, (B, N, H, D) memory viewed as (B, H, N, D), with
    the values dense (B, H, N, D) ones have (the default); the table's header says which. Step cells lay out their
    own inputs, so the option is refused there."""
    import torch

    t = torch.randn(2, 3, 5, 4)
    dense, model = ab_trees.in_layout(t, "bhnd"), ab_trees.in_layout(t.transpose(2, 3).transpose(2, 3), "bnhd")
    assert dense.is_contiguous() and torch.equal(dense, t)
    assert model.transpose(1, 2).is_contiguous() and not model.is_contiguous() and torch.equal(model, t)
    assert model.clone().stride() == model.stride()  # the worker's leaves keep the layout
    with pytest.raises(ValueError, match="layout 'bshd'"):
        ab_trees.in_layout(t, "bshd")
    for layout, words in (("bnhd", "- inputs: q, k, v and dO in (B, N, H, D) memory viewed as (B, H, N, D)"),
                          ("bhnd", "- inputs: q, k, v and dO dense (B, H, N, D)\n")):
        done = _run("--trees", str(ROOT), str(ROOT), "--cells", "16:causal:64", "--rounds", "1", "--tokens", "64",
                    "--heads", "2", "--what", "fwd_bwd", "--impl", "flash-torch", "--layout", layout,
                    "--out", str(tmp_path), "--name", layout)
        assert done.returncode == 0, done.stderr[-2000:]
        assert words in (tmp_path / f"{layout}.md").read_text()
    done = _run("--trees", str(ROOT), str(ROOT), "--what", "step", "--steps", "demo:32", "--layout", "bnhd")
    assert done.returncode == 2 and "--layout lays out attention cells' inputs" in done.stderr
