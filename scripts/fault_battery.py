"""Bad inputs and faults tried against flashsys as a user would, each classified by what happened.

    .venv/bin/python scripts/fault_battery.py            # about 6 minutes on 2 CPU cores
    .venv/bin/python scripts/fault_battery.py ZeRO2      # only the tries whose name contains ZeRO2

Outcomes: clear (a prompt error that says what is wrong), correct (handled: the right answer), unclear (an error
from deep inside torch/gloo), hang (still running at its time limit), crash (killed by a signal), silent (a wrong
answer or a bad input accepted), data lost (another run's or finished training's outputs destroyed). Every try
runs in its own process. The pytest suite checks each of these; this script gives the totals.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import textwrap
import time
from collections import Counter
from pathlib import Path

PY = sys.executable
TINY = ["--d-model", "32", "--layers", "1", "--heads", "2", "--d-ff", "64", "--context-length", "32",
        "--batch-size", "4", "--world-size", "2"]


def python(code: str, timeout: float = 120) -> tuple[int | None, str]:
    """(exit code or None on time-out, output) of a Python snippet; a negative code is a signal."""
    try:
        r = subprocess.run([PY, "-c", textwrap.dedent(code)], capture_output=True, text=True, timeout=timeout,
                           env={**os.environ, "TRITON_INTERPRET": "1"})
        return r.returncode, r.stdout + r.stderr
    except subprocess.TimeoutExpired:
        return None, ""


def train(out: Path, *flags: str, timeout: float = 180) -> tuple[int | None, str]:
    try:
        r = subprocess.run([PY, "-m", "flashsys", "train", *TINY, "--out", str(out), *flags], capture_output=True,
                           text=True, timeout=timeout)
        return r.returncode, r.stdout + r.stderr
    except subprocess.TimeoutExpired:
        return None, ""


def expect_error(result: tuple[int | None, str], message: str) -> str:
    code, out = result
    if code is None:
        return "hang"
    if code < 0:
        return "crash"
    if code == 0:
        return "silent"
    return "clear" if message in out else "unclear"


def expect_ok(result: tuple[int | None, str], marker: str = "OK") -> str:
    code, out = result
    if code is None:
        return "hang"
    if code < 0:
        return "crash"
    return "correct" if code == 0 and marker in out else ("silent" if code == 0 else "unclear")


OP = """
import torch, numpy as np
from flashsys.ops.attention import FlashAttention2Torch, FlashAttention2Triton, attention_reference
op = {op}
q, k, v = (torch.randn(1, 2, 16, 8, requires_grad=True) for _ in range(3))
"""


def op_tries(op: str) -> dict:
    pre = OP.format(op=op)
    t = {}
    for where in "qkv":
        t[f"{op}: NaN in {where} propagates"] = lambda where=where: expect_ok(python(pre + f"""
x = {{'q': q, 'k': k, 'v': v}}
a = {{n: t.detach().clone() for n, t in x.items()}}; a['{where}'][0, 1, 5, 2] = float('nan')
o = op.apply(a['q'], a['k'], a['v'], False)
ref = attention_reference(*(a[n].double() for n in 'qkv'))[0]
assert torch.equal(o.isnan(), ref.isnan()); print('OK')"""))
    t[f"{op}: double backward"] = lambda: expect_error(python(pre + """
torch.autograd.grad(op.apply(q, k, v, True).sum(), q, create_graph=True)"""), "double backward is not supported")
    for flag in ("2", "0.5", "'yes'", "None"):
        t[f"{op}: is_causal={flag}"] = lambda flag=flag: expect_error(python(pre + f"op.apply(q, k, v, {flag})"),
                                                                      "is_causal must be True or False")
    t[f"{op}: is_causal=np.True_"] = lambda: expect_ok(python(pre + "op.apply(q, k, v, np.True_); print('OK')"))
    for scale in ("True", "-1.0", "float('nan')", "'0.5'"):
        t[f"{op}: softmax_scale={scale}"] = lambda scale=scale: expect_error(
            python(pre + f"op.apply(q, k, v, False, {scale})"), "softmax_scale")
    t[f"{op}: mismatched head dims"] = lambda: expect_error(python(pre + "op.apply(q, k[..., :4], v, False)"),
                                                           "head_dim")
    t[f"{op}: int tensors"] = lambda: expect_error(python(pre + "i = torch.ones(1, 4, 8, dtype=torch.long); op.apply(i, i, i, False)"),
                                                   "dtype")
    return t


NN = "import torch\nfrom flashsys.nn import MultiHeadSelfAttention, RotaryEmbedding, TransformerLM\n"

DIST = """
import torch, datetime, torch.distributed as dist
from torch import nn
from flashsys.dist import BucketedDDP, FlatDDP, NaiveDDP, OverlapDDP, spawn
from flashsys.optim import ShardedOptimizer, ZeRO2Optimizer
def make():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4))
"""


def run_dist(body: str, timeout: float = 90) -> tuple[int | None, str]:
    """(exit code or None on time-out, output) of `body` run as worker(rank, world, device) on 2 gloo ranks; the
    launcher prints OK when every rank returned."""
    code = DIST + "def worker(rank, world, device):\n" + textwrap.indent(textwrap.dedent(body), "    ") + \
        "\nif __name__ == '__main__':\n    spawn(worker, 2, backend='gloo', timeout_s=30); print('OK')\n"
    with tempfile.NamedTemporaryFile("w", suffix=".py", delete=False) as f:
        f.write(code)
    try:
        r = subprocess.run([PY, f.name], capture_output=True, text=True, timeout=timeout)
        return r.returncode, r.stdout + r.stderr
    except subprocess.TimeoutExpired:
        return None, ""
    finally:
        os.unlink(f.name)


def dist_try(body: str, message: str) -> str:
    return expect_error(run_dist(body), message)


def dist_tries() -> dict:
    t = {}
    for w in ("NaiveDDP", "FlatDDP", "OverlapDDP", "BucketedDDP"):
        t[f"{w}: unfreeze after wrapping"] = lambda w=w: dist_try(f"""
m = make(); m[0].requires_grad_(False); ddp = {w}(m)
m[0].requires_grad_(True)
ddp(torch.randn(2, 4)).sum().backward(); ddp.finish_gradient_synchronization()""", "requires_grad changed after wrapping")
        t[f"{w}: backward skipped on rank 1"] = lambda w=w: dist_try(f"""
ddp = {w}(make(), process_group=dist.new_group(backend='gloo', timeout=datetime.timedelta(seconds=3)))
out = ddp(torch.randn(2, 4))
if rank == 0: out.sum().backward()
ddp.finish_gradient_synchronization()""", "but not on ranks [1]")
    t["BucketedDDP: bucket size differs per rank"] = lambda: dist_try(
        "BucketedDDP(make(), bucket_size_mb=1e-6 if rank == 0 else None)", "bucket layout differs")
    t["OverlapDDP: parameter used on one rank only"] = lambda: dist_try("""
m = make(); ddp = OverlapDDP(m, process_group=dist.new_group(backend='gloo', timeout=datetime.timedelta(seconds=3)))
x = torch.randn(2, 4)
(m[1](m[0](x)) if rank == 0 else m[0](x)).sum().backward()
ddp.finish_gradient_synchronization()""", "used on some ranks only")
    t["BucketedDDP('auto'), no trainable parameters"] = lambda: expect_ok(run_dist("""
ddp = BucketedDDP(make().requires_grad_(False), bucket_size_mb='auto'); ddp.finish_gradient_synchronization()"""))
    t["ShardedOptimizer.load_state_dict without param_groups"] = lambda: dist_try("""
opt = ShardedOptimizer(make().parameters(), torch.optim.AdamW, lr=1e-3)
opt.load_state_dict({'state': {}})""", "expected a dict with 'state' and 'param_groups'")
    t["ShardedOptimizer.load_state_dict with other shapes"] = lambda: dist_try("""
opt = ShardedOptimizer(make().parameters(), torch.optim.AdamW, lr=1e-3)
groups = [{'params': [0, 1, 2, 3], 'lr': 1e-3, 'betas': (0.9, 0.999), 'eps': 1e-8, 'weight_decay': 0.01, 'amsgrad': False}]
opt.load_state_dict({'state': {0: {'step': torch.tensor(1.0), 'exp_avg': torch.zeros(3, 3), 'exp_avg_sq': torch.zeros(3, 3)}}, 'param_groups': groups})""",
        "has shape")
    for w in ("NaiveDDP", "FlatDDP", "OverlapDDP", "BucketedDDP"):
        t[f"{w}: no finish_gradient_synchronization() call (torch DDP's loop)"] = lambda w=w: expect_ok(run_dist(f"""
m = make(); ddp = {w}(m); opt = torch.optim.SGD(m.parameters(), lr=0.1)
ddp(torch.randn(2, 4) * (rank + 1)).sum().backward(); opt.step()
w0 = [p.detach().clone() for p in m.parameters()]; dist.broadcast_object_list(w0, src=0)
assert all(torch.equal(a, b) for a, b in zip(w0, m.parameters())), 'ranks differ'"""))
        t[f"{w}: wrapping a wrapped model again"] = lambda w=w: dist_try(f"""
m = make(); first = BucketedDDP(m); {w}(m)""", "already wrapped by a live BucketedDDP")
        t[f"{w}: a parameter replaced after wrapping"] = lambda w=w: dist_try(f"""
m = make(); ddp = {w}(m); m[0].weight = nn.Parameter(torch.randn(4, 4))
ddp(torch.randn(2, 4)).sum().backward()""", "parameters changed after wrapping")
    t["BucketedDDP: comm_dtype=torch.int8"] = lambda: dist_try(
        "BucketedDDP(make(), comm_dtype=torch.int8)", "comm_dtype must be one of")
    t["ZeRO2Optimizer: model not wrapped"] = lambda: dist_try(
        "ZeRO2Optimizer(make().parameters(), torch.optim.AdamW, lr=1e-3)", "one live BucketedDDP")
    t["ZeRO2Optimizer: LBFGS (not elementwise)"] = lambda: dist_try("""
m = make(); ddp = BucketedDDP(m); ZeRO2Optimizer(m.parameters(), torch.optim.LBFGS)""", "not known to update each element")
    t["ZeRO2Optimizer.load_state_dict with other shapes"] = lambda: dist_try("""
m = make(); ddp = BucketedDDP(m); opt = ZeRO2Optimizer(m.parameters(), torch.optim.AdamW, lr=1e-3)
groups = [{'params': [0, 1, 2, 3], 'lr': 1e-3}]
opt.load_state_dict({'state': {0: {'step': torch.tensor(1.0), 'exp_avg': torch.zeros(3, 3)}}, 'param_groups': groups})""",
        "has shape")
    t["a dead rank ends the others"] = lambda: dist_try("""
import os
if rank == 1: os._exit(3)
t = torch.ones(3); dist.all_reduce(t); dist.all_reduce(t)""", "rank 1")
    return t


def cli_tries(tmp: Path) -> dict:
    t = {}
    bad = {
        "--out unwritable (/proc/self)": (["--out", "/proc/self/x"], "not a writable directory"),
        "--out ''": (["--out", ""], "--out must name a directory"),
        "--stop-after 0": (["--stop-after", "0"], "--stop-after must be at least 1"),
        "--lr inf": (["--lr", "inf"], "--lr must be a positive finite number"),
        "--checkpoint-every -1": (["--checkpoint-every", "-1"], "--checkpoint-every must be 0"),
        "--timeout 0": (["--timeout", "0"], "--timeout must be a positive number"),
        "--data directory": (["--data", "/tmp"], "is a directory"),
        "--data /dev/null": (["--data", "/dev/null"], "not a regular file"),
        "--batch-size 1000000": (["--batch-size", "1000000"], "needs at least"),
        "--bucket-mb -3": (["--bucket-mb", "-3"], "--bucket-mb must be positive"),
        "--world-size 0": (["--world-size", "0"], "--world-size must be at least 1"),
    }
    for i, (name, (flags, message)) in enumerate(bad.items()):
        def run(flags=flags, message=message, i=i):
            out = tmp / f"bad{i}"
            args = [f for f in flags]
            if "--out" not in args:
                args = ["--out", str(out), *args]
            try:
                r = subprocess.run([PY, "-m", "flashsys", "train", *TINY, *args], capture_output=True, text=True,
                                   timeout=120)
                return expect_error((r.returncode, r.stdout + r.stderr), message)
            except subprocess.TimeoutExpired:
                return "hang"
        t[f"train {name}"] = run

    def fifo():
        path = tmp / "fifo"
        os.mkfifo(path)
        return expect_error(train(tmp / "fifo_out", "--data", str(path), timeout=60), "not a regular file")
    t["train --data FIFO"] = fifo

    def corrupted():
        out = tmp / "corrupt"
        train(out, "--steps", "4", "--checkpoint-every", "2", "--stop-after", "2")
        raw = bytearray((out / "checkpoint.pt").read_bytes())
        mid = len(raw) // 2
        raw[mid:mid + 64] = bytes(b ^ 0xFF for b in raw[mid:mid + 64])
        (out / "checkpoint.pt").write_bytes(bytes(raw))
        return expect_error(train(out, "--steps", "4", "--resume"), "checksum mismatch")
    t["train --resume from a corrupted checkpoint"] = corrupted

    def other_seed():
        out = tmp / "seed"
        train(out, "--steps", "4", "--checkpoint-every", "2", "--stop-after", "2")
        return expect_error(train(out, "--steps", "4", "--resume", "--seed", "7"), "seed 0 -> 7")
    t["train --resume with another seed"] = other_seed

    def diverge():
        out = tmp / "diverge"
        result = train(out, "--steps", "30", "--lr", "1e6", "--checkpoint-every", "1")
        verdict = expect_error(result, "training loss is nan")
        return verdict if not (out / "final_model.pt").exists() else "silent"
    t["train at lr 1e6 (loss becomes NaN)"] = diverge

    def concurrent():
        out = tmp / "shared"
        first = subprocess.Popen([PY, "-m", "flashsys", "train", *TINY, "--steps", "400", "--out", str(out)],
                                 stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        time.sleep(4)
        second = train(out, "--steps", "3")
        first.wait(timeout=300)
        verdict = expect_error(second, "in use by another flashsys run")
        steps = json.loads((out / "summary.json").read_text())["steps"] if (out / "summary.json").exists() else None
        return verdict if steps == 400 else "data lost"
    t["two runs with one --out"] = concurrent

    def orphans():
        out = tmp / "orphan"
        # As a background job of a non-interactive shell: SIGINT ignored, and the ranks inherit that.
        launcher = subprocess.Popen([PY, "-m", "flashsys", "train", *TINY, "--steps", "100000", "--out", str(out)],
                                    stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True,
                                    preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_IGN))
        time.sleep(8)
        kids = [int(p) for p in os.listdir("/proc") if p.isdigit() and _ppid(int(p)) == launcher.pid]
        os.kill(launcher.pid, signal.SIGKILL)
        launcher.wait()
        time.sleep(5)
        alive = [p for p in kids if Path(f"/proc/{p}").exists() and "State:\tZ" not in _status(p)]
        return "correct" if kids and not alive else ("data lost" if alive else "unclear")
    t["launcher (background job) killed: ranks end with it"] = orphans

    def resume_ok():
        a, b = tmp / "straight", tmp / "split"
        train(a, "--steps", "6")
        train(b, "--steps", "6", "--checkpoint-every", "3", "--stop-after", "4")
        train(b, "--steps", "6", "--checkpoint-every", "3", "--resume")
        code, out = python(f"""
import torch
x = torch.load('{a}/final_model.pt'); y = torch.load('{b}/final_model.pt')
assert all(torch.equal(x[k], y[k]) for k in x); print('OK')""")
        return expect_ok((code, out))
    t["kill-and-resume is bit-identical"] = resume_ok
    return t


def _status(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return ""


def _ppid(pid: int) -> int | None:
    for line in _status(pid).splitlines():
        if line.startswith("PPid:"):
            return int(line.split()[1])
    return None


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("only", nargs="?", default="", help="run only the tries whose name contains this")
    only = ap.parse_args().only
    tries: dict = {}
    tries.update(op_tries("FlashAttention2Torch"))
    tries.update(op_tries("FlashAttention2Triton"))
    tries.update({
        "RotaryEmbedding theta -1": lambda: expect_error(python(NN + "RotaryEmbedding(8, 16, theta=-1.0)"), "rope_theta"),
        "RotaryEmbedding theta 0": lambda: expect_error(python(NN + "RotaryEmbedding(8, 16, theta=0.0)"), "rope_theta"),
        "TransformerLM rope_theta -5": lambda: expect_error(python(NN + "TransformerLM(10, 8, 8, 1, 2, 16, rope_theta=-5.0)"), "rope_theta"),
        "MHSA d_model -8": lambda: expect_error(python(NN + "MultiHeadSelfAttention(-8, 2)"), "d_model must be a positive integer"),
        "MHSA rank-2 input": lambda: expect_error(python(NN + "MultiHeadSelfAttention(16, 2)(torch.randn(2, 16))"), "must have shape"),
        "MHSA wrong width": lambda: expect_error(python(NN + "MultiHeadSelfAttention(16, 2)(torch.randn(1, 4, 12))"), "must have shape"),
        "MHSA int input": lambda: expect_error(python(NN + "MultiHeadSelfAttention(16, 2)(torch.ones(1, 4, 16, dtype=torch.long))"), "floating-point"),
        "TransformerLM token out of range": lambda: expect_error(python(NN + "TransformerLM(10, 8, 8, 1, 2, 16)(torch.full((1, 4), 10))"), "token ids must lie"),
    })
    tries.update(dist_tries())
    with tempfile.TemporaryDirectory() as tmp:
        tries.update(cli_tries(Path(tmp)))
        chosen = {name: run for name, run in tries.items() if only in name}
        if not chosen:
            ap.error(f"no try's name contains {only!r}")
        results = {}
        for name, run in chosen.items():
            t0 = time.time()
            results[name] = run()
            print(f"{results[name]:10s} {time.time() - t0:5.1f}s  {name}", flush=True)
    totals = Counter(results.values())
    order = ["clear", "correct", "unclear", "hang", "crash", "silent", "data lost"]
    print("\ntried {} / ".format(len(results)) + " / ".join(f"{k} {totals.get(k, 0)}" for k in order))
    return 0 if set(totals) <= {"clear", "correct"} else 1


if __name__ == "__main__":
    raise SystemExit(main())
