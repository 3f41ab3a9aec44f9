"""`flashsys train` and `flashsys info`: a 2-process CPU run, bit-identical resume, and every bad input."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from flashsys.__main__ import main

TINY = ["--d-model", "32", "--layers", "1", "--heads", "2", "--d-ff", "64", "--context-length", "32",
        "--batch-size", "4", "--world-size", "2"]


def _train(out: Path, *extra: str) -> int:
    return main(["train", *TINY, "--out", str(out), *extra])


def test_two_process_cpu_run_writes_its_outputs(tmp_path):
    assert _train(tmp_path, "--steps", "12") == 0
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["world_size"] == 2 and summary["steps"] == 12
    assert summary["final_train_loss"] < summary["first_train_loss"]
    assert len(summary["peak_memory_mb_per_rank"]) == 2
    assert summary["sample"].startswith("Alice ")
    assert (tmp_path / "loss.png").stat().st_size > 1000
    assert (tmp_path / "final_model.pt").is_file()


def test_resume_reaches_bit_identical_weights(tmp_path):
    straight, split = tmp_path / "straight", tmp_path / "split"
    assert _train(straight, "--steps", "6") == 0
    assert _train(split, "--steps", "6", "--checkpoint-every", "3", "--stop-after", "4") == 0  # "killed" after step 4
    assert not list(split.glob("*.tmp-*")), "temporary checkpoint left behind"
    assert _train(split, "--steps", "6", "--checkpoint-every", "3", "--resume") == 0
    a = torch.load(straight / "final_model.pt")
    b = torch.load(split / "final_model.pt")
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k], b[k]), k


def test_resume_also_works_without_sharding(tmp_path):
    assert _train(tmp_path, "--steps", "4", "--checkpoint-every", "2", "--stop-after", "2", "--no-shard") == 0
    assert _train(tmp_path, "--steps", "4", "--resume", "--no-shard") == 0


def test_corrupted_or_incompatible_checkpoint_is_a_clear_error(tmp_path, capsys):
    (tmp_path / "checkpoint.pt").write_bytes(b"not a checkpoint at all")
    assert _train(tmp_path, "--steps", "4", "--resume") == 2
    assert "corrupted" in capsys.readouterr().err
    assert _train(tmp_path / "fresh", "--steps", "2", "--checkpoint-every", "2") == 0
    assert main(["train", *TINY[:-6], "--context-length", "32", "--batch-size", "4", "--world-size", "2",
                 "--d-model", "64", "--out", str(tmp_path / "fresh"), "--steps", "4", "--resume"]) == 2
    assert "does not match" in capsys.readouterr().err
    assert _train(tmp_path / "missing", "--resume") == 2
    assert "no checkpoint" in capsys.readouterr().err


@pytest.mark.parametrize(
    "content,message",
    [(None, "not found"), (b"", "empty"), (b"\xff\xfe\x00bad" * 20, "not UTF-8"), (b"too short", "too short")],
    ids=["missing", "empty", "not-utf8", "short"],
)
def test_bad_data_files_are_clear_errors(tmp_path, capsys, content, message):
    data = tmp_path / "data.txt"
    if content is not None:
        data.write_bytes(content)
    out = tmp_path / "out"
    assert _train(out, "--data", str(data), "--checkpoint-every", "1") == 2
    assert message in capsys.readouterr().err
    assert not (out / "checkpoint.pt").exists()


def test_world_size_larger_than_batch_is_a_clear_error(tmp_path, capsys):
    assert main(["train", "--world-size", "4", "--batch-size", "2", "--out", str(tmp_path)]) == 2
    assert "larger than --batch-size" in capsys.readouterr().err


def test_help_and_info():
    for args in (["train", "--help"], ["--help"]):
        r = subprocess.run([sys.executable, "-m", "flashsys", *args], capture_output=True, text=True, timeout=120)
        assert r.returncode == 0 and "--checkpoint-every" in r.stdout or "train" in r.stdout
    r = subprocess.run([sys.executable, "-m", "flashsys", "info"], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert "torch" in r.stdout and "flash-torch" in r.stdout and "works" in r.stdout


def test_runs_under_torchrun(tmp_path):
    """The env:// path: ranks come from torchrun's environment, no processes are spawned by flashsys."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
           "-m", "flashsys", "train", *TINY[:-2], "--steps", "4", "--out", str(tmp_path)]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["world_size"] == 2 and summary["steps"] == 4


def test_attention_flag_and_resume_with_another_backend(tmp_path):
    """--attention picks the model's backend from the registry; a checkpoint resumes under another one (same
    weights), but not with another shape."""
    assert _train(tmp_path, "--steps", "4", "--checkpoint-every", "2", "--stop-after", "2", "--attention", "naive") == 0
    assert _train(tmp_path, "--steps", "4", "--resume", "--attention", "sdpa") == 0
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["steps"] == 4
