"""`flashsys train` and `flashsys info`: a 2-process CPU run, bit-identical resume, and every bad input."""

from __future__ import annotations

import json
import math
import re
import shutil
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


def test_a_checkpoint_from_before_the_newer_model_fields_still_resumes(tmp_path):
    """Checkpoints written before ModelConfig had num_kv_heads and attention_window lack those keys: their
    defaults fill in, so the same model is not refused as a different one."""
    from flashsys.checkpoint import CHECKPOINT, load_checkpoint, save_checkpoint_atomically

    assert _train(tmp_path, "--steps", "4", "--checkpoint-every", "2", "--stop-after", "2") == 0
    ckpt = load_checkpoint(tmp_path / CHECKPOINT)
    for key in ("num_kv_heads", "attention_window"):
        del ckpt["config"]["model"][key]
    save_checkpoint_atomically(ckpt, tmp_path / CHECKPOINT)
    assert _train(tmp_path, "--steps", "4", "--checkpoint-every", "2", "--resume") == 0


def test_checkpoints_move_between_zero_stages_bit_identically(tmp_path):
    """ZeRO-1 and ZeRO-2 save the unsharded optimizer's layout: a run checkpointed under one resumes under the
    other, and on 2 ranks (sums of two in either order) it ends where the uninterrupted ZeRO-2 run ends."""
    straight, split = tmp_path / "straight", tmp_path / "split"
    assert _train(straight, "--steps", "4") == 0
    assert _train(split, "--steps", "4", "--checkpoint-every", "2", "--stop-after", "2", "--zero-stage", "1") == 0
    assert _train(split, "--steps", "4", "--resume") == 0
    a, b = torch.load(straight / "final_model.pt"), torch.load(split / "final_model.pt")
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


def test_under_torchrun_the_ranks_share_checking_a_sharded_checkpoint(tmp_path):
    """Under torchrun there is no launcher to read a sharded checkpoint first: each rank checks a share of its files,
    and every rank stops with the same error when one is damaged."""
    def torchrun(out: Path, *extra: str) -> subprocess.CompletedProcess:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", "-m", "flashsys",
               "train", *TINY[:-2], "--steps", "4", "--checkpoint-format", "sharded", "--out", str(out), *extra]
        return subprocess.run(cmd, capture_output=True, text=True, timeout=300)

    good, damaged = tmp_path / "good", tmp_path / "damaged"
    r = torchrun(good, "--checkpoint-every", "2", "--stop-after", "2")
    assert r.returncode == 0, r.stderr[-3000:]
    shutil.copytree(good, damaged)
    _flip_a_byte(damaged / "checkpoint" / "__1_0.distcp")
    r = torchrun(damaged, "--resume")
    assert r.returncode != 0 and r.stderr.count("__1_0.distcp in") == 2, r.stderr[-3000:]
    r = torchrun(good, "--resume")
    assert r.returncode == 0, r.stderr[-3000:]
    assert json.loads((good / "summary.json").read_text())["steps"] == 4


def test_attention_flag_and_resume_with_another_backend(tmp_path):
    """--attention picks the model's backend from the registry; a checkpoint resumes under another one (same
    weights), but not with another shape."""
    assert _train(tmp_path, "--steps", "4", "--checkpoint-every", "2", "--stop-after", "2", "--attention", "naive") == 0
    assert _train(tmp_path, "--steps", "4", "--resume", "--attention", "sdpa") == 0
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["steps"] == 4


def test_a_corrupted_checkpoint_is_refused_not_trained_on(tmp_path, capsys):
    """64 flipped bytes in the middle of a checkpoint: the checksum catches it (it used to train at loss=nan)."""
    assert _train(tmp_path, "--steps", "4", "--checkpoint-every", "2", "--stop-after", "2") == 0
    path = tmp_path / "checkpoint.pt"
    raw = bytearray(path.read_bytes())
    mid = len(raw) // 2
    raw[mid : mid + 64] = bytes(b ^ 0xFF for b in raw[mid : mid + 64])
    path.write_bytes(bytes(raw))
    capsys.readouterr()
    assert _train(tmp_path, "--steps", "4", "--resume") == 2
    assert "checksum mismatch" in capsys.readouterr().err


def test_resume_with_other_trajectory_settings_needs_force(tmp_path, capsys):
    assert _train(tmp_path, "--steps", "4", "--checkpoint-every", "2", "--stop-after", "2") == 0
    capsys.readouterr()
    assert _train(tmp_path, "--steps", "4", "--resume", "--seed", "5", "--lr", "0.01") == 2
    err = capsys.readouterr().err
    assert "seed 0 -> 5" in err and "lr 0.003 -> 0.01" in err and "--force" in err
    assert _train(tmp_path, "--steps", "4", "--resume", "--seed", "5", "--force") == 0


def test_a_diverging_run_stops_with_a_clear_error_and_keeps_its_last_good_checkpoint(tmp_path, capsys):
    from flashsys.checkpoint import load_checkpoint

    assert _train(tmp_path, "--steps", "30", "--lr", "1e6", "--checkpoint-every", "1") == 1
    err = capsys.readouterr().err
    assert "training loss is nan" in err and "failed first: TrainingDiverged" in err  # every rank sees the NaN
    ckpt = load_checkpoint(tmp_path / "checkpoint.pt")  # verified: intact
    assert all(math.isfinite(loss) for _, loss in ckpt["history"])
    assert not (tmp_path / "final_model.pt").exists()


@pytest.mark.parametrize("flags,message", [
    (["--checkpoint-every", "-1"], "--checkpoint-every must be 0"),
    (["--stop-after", "0"], "--stop-after must be at least 1"),
    (["--lr", "inf"], "--lr must be a positive finite number"),
    (["--lr", "nan"], "--lr must be a positive finite number"),
    (["--timeout", "0"], "--timeout must be a positive number"),
    (["--batch-size", "1000000"], "needs at least"),
    (["--data", "/dev/null"], "not a regular file"),
    (["--data", "/tmp"], "is a directory"),
    (["--kv-heads", "3"], "--kv-heads must divide --heads 2"),
    (["--attention-window", "-1"], "--attention-window must be 0 or more"),
    (["--pack-documents", "--attention", "sdpa"], "--pack-documents needs a flash attention backend"),
    (["--zero-stage", "1", "--no-shard"], "--zero-stage 1 shards the optimizer and --no-shard asks for none"),
], ids=lambda v: v if isinstance(v, str) else "-".join(v))
def test_bad_flags_are_refused_before_training(tmp_path, capsys, flags, message):
    assert _train(tmp_path / "out", *flags) == 2
    assert message in capsys.readouterr().err
    assert not (tmp_path / "out" / "final_model.pt").exists()


def test_empty_and_unwritable_out_are_refused_before_training(tmp_path, capsys):
    assert main(["train", *TINY, "--out", ""]) == 2
    assert "--out must name a directory" in capsys.readouterr().err
    assert main(["train", *TINY, "--out", "/proc/self/flashsys"]) == 2
    assert "not a writable directory" in capsys.readouterr().err


def test_two_runs_cannot_share_an_output_directory(tmp_path, capsys):
    from flashsys.train import run_directory_lock

    with run_directory_lock(tmp_path):  # as another live run would hold it
        assert _train(tmp_path, "--steps", "2") == 2
    assert "in use by another flashsys run" in capsys.readouterr().err
    assert _train(tmp_path, "--steps", "2") == 0  # the lock dies with its holder


def test_a_failed_final_save_keeps_the_weights(tmp_path):
    from flashsys.train import save_or_rescue

    state = {"w": torch.arange(3.0)}
    with pytest.raises(OSError, match="saved to") as info:
        save_or_rescue(state, tmp_path / "gone" / "final_model.pt")
    rescued = Path(str(info.value).rsplit("saved to ", 1)[1].split(" instead")[0])
    assert torch.equal(torch.load(rescued)["w"], state["w"])


def test_ranks_die_with_their_launcher(tmp_path):
    """SIGKILL the launcher of a long run started as a background job of a non-interactive shell (SIGINT
    ignored, and inherited): its ranks must not train on and write --out. torch's spawn makes SIGINT the ranks'
    parent-death signal, which such ranks ignore; they used to survive."""
    import os
    import signal
    import time

    launcher = subprocess.Popen([sys.executable, "-m", "flashsys", "train", *TINY, "--steps", "100000",
                                 "--out", str(tmp_path)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                                start_new_session=True, preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_IGN))

    def children() -> list[int]:
        found = []
        for pid in filter(str.isdigit, os.listdir("/proc")):
            try:
                status = Path(f"/proc/{pid}/status").read_text()
            except OSError:
                continue
            ppid = next(int(line.split()[1]) for line in status.splitlines() if line.startswith("PPid:"))
            state = next(line.split()[1] for line in status.splitlines() if line.startswith("State:"))
            if ppid == launcher.pid and state != "Z":
                found.append(int(pid))
        return found

    try:
        deadline = time.time() + 120
        while len(children()) < 2 and time.time() < deadline:
            time.sleep(0.5)
        ranks = children()
        assert len(ranks) >= 2, "the ranks did not start"
        time.sleep(3)  # let them get into training
        os.kill(launcher.pid, signal.SIGKILL)
        launcher.wait()
        deadline = time.time() + 20
        alive = ranks
        while alive and time.time() < deadline:
            time.sleep(0.5)
            alive = [pid for pid in ranks if Path(f"/proc/{pid}").exists()
                     and "State:\tZ" not in Path(f"/proc/{pid}/status").read_text()]
        assert not alive, f"ranks {alive} outlived their launcher"
    finally:
        if launcher.poll() is None:
            launcher.kill()


def test_one_process_run_trains_the_unwrapped_model(tmp_path):
    """World size 1: no data-parallel wrapper and no sharding, same outputs; throughput is measured after warm-up.
    The model has one K/V head for its two query heads and an 8-token sliding window."""
    out = tmp_path / "one"
    assert main(["train", *TINY[:-2], "--world-size", "1", "--steps", "10", "--kv-heads", "1", "--attention-window",
                 "8", "--out", str(out)]) == 0
    summary = json.loads((out / "summary.json").read_text())
    assert summary["world_size"] == 1 and summary["steps"] == 10
    assert summary["final_train_loss"] < summary["first_train_loss"]
    assert summary["tokens_per_s"] > 0 and summary["mfu"] is None  # no peak FLOP/s is known for a CPU


def test_documents_are_cut_at_blank_lines_and_packed_per_row():
    from flashsys.corpus import document_ids, packed_offsets

    data = torch.frombuffer(bytearray(b"ab\n\ncd\n\nefg"), dtype=torch.uint8)
    ids = document_ids(data)
    assert ids.tolist() == [0, 0, 0, 0, 1, 1, 1, 1, 2, 2, 2]
    offsets, longest = packed_offsets(ids[None, 1:9].repeat(2, 1))  # two rows of "b\n\ncd\n\ne"
    assert offsets.dtype == torch.int32 and offsets.tolist() == [0, 3, 7, 8, 11, 15, 16] and longest == 4


def test_packed_document_run_trains_and_resumes_bit_identically(tmp_path):
    """--pack-documents: attention stops at blank lines (flash_attention_varlen); resuming continues exactly."""
    straight, split = tmp_path / "straight", tmp_path / "split"
    assert _train(straight, "--steps", "6", "--pack-documents") == 0
    assert _train(split, "--steps", "6", "--pack-documents", "--checkpoint-every", "3", "--stop-after", "3") == 0
    assert _train(split, "--steps", "6", "--checkpoint-every", "3", "--resume") == 2  # packing differs: refused
    assert _train(split, "--steps", "6", "--pack-documents", "--checkpoint-every", "3", "--resume") == 0
    a, b = torch.load(straight / "final_model.pt"), torch.load(split / "final_model.pt")
    assert all(torch.equal(a[k], b[k]) for k in a)
    summary = json.loads((straight / "summary.json").read_text())
    assert summary["final_train_loss"] < summary["first_train_loss"]


def test_one_rank_runs_write_checkpoints_and_resume_two_rank_ones(tmp_path):
    """One rank trains with plain AdamW: its checkpoints need no consolidation. It resumes its own checkpoint, and
    a 2-rank run's (ZeRO-2, consolidated) one: the global batch and its order do not depend on the world size."""
    one = [*TINY[:-2], "--world-size", "1"]
    assert main(["train", *one, "--steps", "4", "--checkpoint-every", "2", "--stop-after", "2",
                 "--out", str(tmp_path / "one")]) == 0
    assert main(["train", *one, "--steps", "4", "--checkpoint-every", "2", "--resume",
                 "--out", str(tmp_path / "one")]) == 0
    assert _train(tmp_path / "two", "--steps", "4", "--checkpoint-every", "2", "--stop-after", "2") == 0
    assert main(["train", *one, "--steps", "4", "--resume", "--out", str(tmp_path / "two")]) == 0
    assert (tmp_path / "two" / "final_model.pt").is_file()


def test_resume_refuses_a_data_file_whose_contents_changed(tmp_path, capsys):
    from flashsys.corpus import DEFAULT_DATA

    data = tmp_path / "data.txt"
    text = Path(DEFAULT_DATA).read_text()
    data.write_text(text)
    out = tmp_path / "out"
    assert _train(out, "--steps", "4", "--data", str(data), "--checkpoint-every", "2", "--stop-after", "2") == 0
    data.write_text(text.upper())  # the same path, other text
    capsys.readouterr()
    assert _train(out, "--steps", "4", "--data", str(data), "--resume") == 2
    assert "the data file's contents (sha256)" in capsys.readouterr().err
    data.write_text(text)
    assert _train(out, "--steps", "4", "--data", str(data), "--resume") == 0


def test_a_changed_step_count_names_the_flag_that_set_the_warm_up(tmp_path, capsys):
    assert _train(tmp_path, "--steps", "10", "--checkpoint-every", "2", "--stop-after", "2") == 0
    capsys.readouterr()
    assert _train(tmp_path, "--steps", "20", "--resume") == 2
    assert "warm-up steps (set by --steps) 1 -> 2" in capsys.readouterr().err


@pytest.mark.parametrize("damage,match", [
    (lambda c: c.update(step=-2), "step -2 is not a count of steps"),
    (lambda c: c["optimizer"].update(state={}), "optimizer state for 0 of"),
    (lambda c: c.update(step=1, history=c["history"][:1]), "counts \\[2.0\\] steps, the checkpoint 1"),
    (lambda c: c.update(history=[(5, 1.0)]), "does not end at step 2"),
    (lambda c: c["model"].update(extra="code"), "not tensors"),
], ids=["negative-step", "no-optimizer-state", "step-behind-optimizer", "history", "non-tensor"])
def test_a_re_signed_checkpoint_with_inconsistent_contents_is_refused(tmp_path, capsys, damage, match):
    """A valid checksum proves the bytes are the ones written, not that a run wrote them."""
    from flashsys.checkpoint import CHECKPOINT, load_checkpoint, save_checkpoint_atomically

    assert _train(tmp_path, "--steps", "4", "--checkpoint-every", "2", "--stop-after", "2") == 0
    ckpt = load_checkpoint(tmp_path / CHECKPOINT)
    damage(ckpt)
    save_checkpoint_atomically(ckpt, tmp_path / CHECKPOINT)  # re-signed: the checksum matches the new payload
    capsys.readouterr()
    assert _train(tmp_path, "--steps", "4", "--resume") == 2
    err = capsys.readouterr().err
    assert "inconsistent" in err and re.search(match, err), err


def test_zero3_trains_like_zero2_and_its_checkpoints_move_between_them(tmp_path, capsys):
    """--zero-stage 3 (torch's FSDP2): the same trajectory as ZeRO-2 on 2 ranks in float32 (the sums of two
    gradients agree; FSDP2 divides in its own order), and one checkpoint format: a ZeRO-3 checkpoint resumes under
    ZeRO-2 and the other way round, its final weights loading into a plain model."""
    zero2, zero3, mixed = tmp_path / "zero2", tmp_path / "zero3", tmp_path / "mixed"
    assert _train(zero2, "--steps", "4") == 0
    assert _train(zero3, "--steps", "4", "--zero-stage", "3") == 0
    a, b = torch.load(zero2 / "final_model.pt"), torch.load(zero3 / "final_model.pt")
    assert a.keys() == b.keys()
    for k in a:
        torch.testing.assert_close(b[k], a[k], rtol=1e-5, atol=1e-6, msg=k)
    assert _train(mixed, "--steps", "4", "--zero-stage", "3", "--checkpoint-every", "2", "--stop-after", "2") == 0
    assert _train(mixed, "--steps", "4", "--resume") == 0  # ZeRO-2 takes the ZeRO-3 checkpoint
    c = torch.load(mixed / "final_model.pt")
    for k in a:
        torch.testing.assert_close(c[k], a[k], rtol=1e-5, atol=1e-6, msg=k)
    assert _train(mixed, "--steps", "6", "--zero-stage", "3", "--resume", "--force") == 0  # and back
    summary = json.loads((zero3 / "summary.json").read_text())
    assert summary["final_train_loss"] < summary["first_train_loss"]
    capsys.readouterr()
    assert main(["train", *TINY[:-2], "--world-size", "1", "--zero-stage", "3", "--out", str(tmp_path / "one")]) == 2
    assert "nothing to shard" in capsys.readouterr().err


def _same_weights(a: Path, b: Path) -> bool:
    x, y = torch.load(a / "final_model.pt"), torch.load(b / "final_model.pt")
    return x.keys() == y.keys() and all(torch.equal(x[k], y[k]) for k in x)


def test_sharded_checkpoints_resume_bit_identically_under_every_strategy(tmp_path):
    """--checkpoint-format sharded: each rank writes its own file; a run killed after step 2 resumes to the weights
    of the uninterrupted run, under the strategy that wrote it or another (ZeRO-3 <-> ZeRO-1/2, DDP), and on one
    rank (the same math up to the order of the two half-batch sums)."""
    from flashsys.sharded_checkpoint import MANIFEST, SHARDED_CHECKPOINT

    straight = tmp_path / "straight"
    assert _train(straight, "--steps", "4") == 0
    sharded = ("--checkpoint-format", "sharded")
    for first, then in [("2", "2"), ("3", "1"), ("2", "3")]:
        out = tmp_path / f"zero{first}-then-zero{then}"
        assert _train(out, "--steps", "4", "--checkpoint-every", "2", "--stop-after", "2", "--zero-stage", first,
                      *sharded) == 0
        manifest = json.loads((out / SHARDED_CHECKPOINT / MANIFEST).read_text())["body"]
        assert {"__0_0.distcp", "__1_0.distcp"} <= manifest["files"].keys(), "every rank writes its part"
        assert not (out / "checkpoint.pt").exists() and not (out / (SHARDED_CHECKPOINT + ".tmp")).exists()
        assert _train(out, "--steps", "4", "--zero-stage", then, "--resume", *sharded) == 0
        assert _same_weights(straight, out), (first, then)
    ddp = tmp_path / "ddp"
    assert _train(ddp, "--steps", "4", "--checkpoint-every", "2", "--stop-after", "2", "--no-shard", *sharded) == 0
    assert _train(ddp, "--steps", "4", "--resume", *sharded) == 0  # ZeRO-2 reads what DDP's ranks wrote
    assert _same_weights(straight, ddp)
    one = tmp_path / "one"
    assert _train(one, "--steps", "4", "--checkpoint-every", "2", "--stop-after", "2", *sharded) == 0
    assert main(["train", *TINY[:-2], "--world-size", "1", "--steps", "4", "--resume", "--out", str(one)]) == 0
    a, b = torch.load(straight / "final_model.pt"), torch.load(one / "final_model.pt")
    for k in a:
        torch.testing.assert_close(b[k], a[k], rtol=1e-5, atol=1e-6, msg=k)


def test_convert_moves_checkpoints_between_the_formats_exactly(tmp_path, capsys):
    """`flashsys convert`: a sharded checkpoint becomes the one-file checkpoint a file-format run writes at the same
    step (every tensor and setting equal), and back; a run resumes from either."""
    from flashsys.checkpoint import CHECKPOINT, load_checkpoint

    file_run, sharded_run = tmp_path / "file", tmp_path / "sharded"
    assert _train(file_run, "--steps", "4", "--checkpoint-every", "2", "--stop-after", "2") == 0
    assert _train(sharded_run, "--steps", "4", "--checkpoint-every", "2", "--stop-after", "2",
                  "--checkpoint-format", "sharded") == 0
    converted = tmp_path / "converted.pt"
    assert main(["convert", str(sharded_run / "checkpoint"), str(converted)]) == 0
    a, b = load_checkpoint(file_run / CHECKPOINT), load_checkpoint(converted)
    assert (a["step"], a["history"]) == (b["step"], b["history"])
    assert all(torch.equal(a["model"][k], b["model"][k]) for k in a["model"])
    assert a["optimizer"]["param_groups"] == b["optimizer"]["param_groups"]
    sa, sb = a["optimizer"]["state"], b["optimizer"]["state"]
    assert sa.keys() == sb.keys()
    assert all(torch.equal(sa[i][n], sb[i][n]) and sa[i][n].dtype == sb[i][n].dtype for i in sa for n in sa[i])
    assert main(["convert", str(converted), str(converted)]) == 2
    assert "replaces nothing" in capsys.readouterr().err
    back = tmp_path / "back"
    back.mkdir()
    assert main(["convert", str(file_run / CHECKPOINT), str(back / "checkpoint")]) == 0
    assert _train(back, "--steps", "4", "--resume") == 0  # no checkpoint.pt: the sharded one is read
    straight = tmp_path / "straight"
    assert _train(straight, "--steps", "4") == 0
    assert _same_weights(straight, back)


def _flip_a_byte(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    path.write_bytes(bytes(data))


@pytest.mark.parametrize("damage,message", [
    (lambda d: (d / "__1_0.distcp").unlink(), "shards are missing"),
    (lambda d: _flip_a_byte(d / "__0_0.distcp"), "do not match the manifest"),
    (lambda d: (d / ".metadata").unlink(), "shards are missing"),
    (lambda d: (d / "flashsys.json").write_text((d / "flashsys.json").read_text().replace('"step": 2', '"step": 3')),
     "corrupted"),
], ids=["missing-shard", "damaged-shard", "no-dcp-metadata", "edited-manifest"])
def test_a_damaged_sharded_checkpoint_is_refused(tmp_path, capsys, damage, message):
    out = tmp_path / "run"
    assert _train(out, "--steps", "4", "--checkpoint-every", "2", "--stop-after", "2",
                  "--checkpoint-format", "sharded") == 0
    damage(out / "checkpoint")
    capsys.readouterr()
    assert _train(out, "--steps", "4", "--resume", "--checkpoint-format", "sharded") == 2
    assert message in capsys.readouterr().err


def test_a_shard_from_another_run_is_refused(tmp_path, capsys):
    """Two runs' checkpoints with identical file names: a shard copied from the other is caught by its digest."""
    runs = [tmp_path / "a", tmp_path / "b"]
    for seed, out in enumerate(runs):
        assert _train(out, "--steps", "4", "--checkpoint-every", "2", "--stop-after", "2", "--seed", str(seed),
                      "--checkpoint-format", "sharded") == 0
    (runs[0] / "checkpoint" / "__1_0.distcp").write_bytes((runs[1] / "checkpoint" / "__1_0.distcp").read_bytes())
    capsys.readouterr()
    assert _train(runs[0], "--steps", "4", "--resume", "--checkpoint-format", "sharded") == 2
    assert "__1_0.distcp" in capsys.readouterr().err
