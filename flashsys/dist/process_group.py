"""Process-group set-up and tear-down for torchrun (single or multi-node) and for mp.spawn on one machine."""

from __future__ import annotations

import datetime
import gc
import json
import os
import signal
import socket
import sys
import tempfile
import threading
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

# torch.distributed.nn.functional binds `group=group.WORLD` as default arguments when it is imported. torch
# imports it lazily (the first optimizer or compile call imports torch._dynamo, which imports it); if that
# happens after init_process_group, ten defaults pin the world group, destroy_process_group cannot free it,
# and gloo's worker threads outlive the interpreter (see `shutdown`). Imported here, before any group
# exists, the defaults are None.
if dist.is_available():
    import torch.distributed.nn.functional  # noqa: E402,F401

DEFAULT_TIMEOUT_S = 300.0


def default_backend() -> str:
    """NCCL when CUDA is available, gloo otherwise."""
    return "nccl" if torch.cuda.is_available() else "gloo"


def find_free_port() -> int:
    """A TCP port that is free right now on this machine (never a hard-coded one).

    Another process may bind it between this call and yours; `spawn` does not use it (its rank 0 binds port 0
    and publishes the port it got). For a port you hand to torchrun or `init_for_spawn` yourself.
    """
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launched_by_torchrun() -> bool:
    """True when torchrun's RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT are all in the environment."""
    return all(k in os.environ for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"))


def _set_device(backend: str, local_rank: int) -> torch.device:
    if backend == "nccl" or (torch.cuda.is_available() and backend != "gloo"):
        torch.cuda.set_device(local_rank % torch.cuda.device_count())
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def init_from_env(backend: str | None = None, timeout_s: float = DEFAULT_TIMEOUT_S) -> tuple[int, int, torch.device]:
    """Join the process group that torchrun describes in the environment (env://). Returns (rank, world, device).

    On CUDA each process uses GPU LOCAL_RANK. Works for one node and many
    (`torchrun --nnodes N --node-rank R --master-addr HOST --master-port PORT --nproc-per-node G ...`).
    """
    if not launched_by_torchrun():
        raise RuntimeError("init_from_env needs RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT (set by torchrun)")
    backend = backend or default_backend()
    device = _set_device(backend, int(os.environ.get("LOCAL_RANK", "0")))
    dist.init_process_group(backend, init_method="env://", timeout=datetime.timedelta(seconds=timeout_s))
    return dist.get_rank(), dist.get_world_size(), device


def init_for_spawn(
    rank: int, world_size: int, port: int, backend: str | None = None, timeout_s: float = DEFAULT_TIMEOUT_S
) -> torch.device:
    """Join a single-machine process group on 127.0.0.1:port. Returns this rank's device."""
    return _join(rank, world_size, backend, timeout_s, init_method=f"tcp://127.0.0.1:{port}")


def _join(rank: int, world_size: int, backend: str | None, timeout_s: float, **rendezvous) -> torch.device:
    """This rank's device set and the group joined through `rendezvous` (an init_method or a store)."""
    backend = backend or default_backend()
    device = _set_device(backend, rank)
    dist.init_process_group(backend, rank=rank, world_size=world_size, timeout=datetime.timedelta(seconds=timeout_s),
                            **rendezvous)
    return device


PORT_FILE = "rendezvous_port"


def _rendezvous_store(rank: int, world_size: int, rendezvous_dir: str, timeout_s: float) -> dist.TCPStore:
    """The spawned group's TCPStore. Rank 0 binds port 0, so the kernel hands it a port nobody holds, and
    publishes that port in rendezvous_dir; the other ranks wait for the file and connect. A port chosen by the
    launcher and bound later by rank 0 can be taken in between by any other process on the machine (two test
    runs, two jobs), which failed the whole launch with EADDRINUSE."""
    timeout = datetime.timedelta(seconds=timeout_s)
    port_file = Path(rendezvous_dir, PORT_FILE)
    if rank == 0:
        store = dist.TCPStore("127.0.0.1", 0, world_size, is_master=True, timeout=timeout, wait_for_workers=False)
        staging = port_file.with_suffix(".tmp")
        staging.write_text(str(store.port))
        staging.replace(port_file)  # atomic: a reader never sees a half-written port
        return store
    deadline = time.monotonic() + timeout_s
    while not port_file.exists():
        if time.monotonic() > deadline:
            raise TimeoutError(f"rank {rank}: rank 0 did not publish the rendezvous port within {timeout_s:g} s")
        time.sleep(0.01)
    return dist.TCPStore("127.0.0.1", int(port_file.read_text()), world_size, is_master=False, timeout=timeout)



def shutdown() -> None:
    """Destroy the process group and join its worker threads while the interpreter is still whole.

    destroy_process_group only unregisters the group. Its C++ object, and gloo's worker threads with it,
    lives until the last reference goes. If that is at interpreter exit, a worker thread still dropping the
    last collective's tensors needs the GIL, is ended by the finalising interpreter, and the process aborts
    ("terminate called without an active exception") after all its work succeeded. Collecting here frees
    a group held only by reference cycles now, and its destructor joins the threads. (References that are
    not cycles must be gone too: see the import of torch.distributed.nn.functional above.)
    """
    if dist.is_initialized():
        dist.destroy_process_group()
    gc.collect()


class SpawnError(RuntimeError):
    """One or more spawned ranks failed. The message names every rank's own exception, the first failure first
    (with its traceback): the others are usually its consequences, such as a peer's closed connection.

    Attributes:
        failures: [{"rank", "type", "message", "traceback", "time"}] of the ranks that reported, in time order.
    """

    def __init__(self, failures: list[dict], world_size: int, cause: BaseException) -> None:
        self.failures = failures
        lines = []
        if failures:
            first = failures[0]
            lines.append(f"rank {first['rank']} failed first: {first['type']}: {first['message']}")
            lines += ["", first["traceback"].rstrip(), ""]
        reported = {f["rank"] for f in failures}
        for f in failures[1:]:
            lines.append(f"rank {f['rank']}: {f['type']}: {f['message'].splitlines()[0] if f['message'] else ''}")
        exit_code = getattr(cause, "exit_code", None)
        for rank in range(world_size):
            if rank in reported:
                continue
            if getattr(cause, "error_index", None) == rank and getattr(cause, "signal_name", None):
                lines.append(f"rank {rank}: killed by {cause.signal_name}"
                             + (" (out of memory?)" if cause.signal_name == "SIGKILL" else ""))
            elif getattr(cause, "error_index", None) == rank and exit_code is not None:
                lines.append(f"rank {rank}: exited with code {exit_code}")
            else:
                lines.append(f"rank {rank}: stopped by the launcher after the failure above")
        super().__init__("\n".join(lines))


def _die_with_parent(parent_pid: int) -> None:
    """End this rank when its launcher ends, however it ends (SIGKILL included): a rank left behind would train
    on and write the run's outputs. Linux delivers SIGKILL on the parent's death (prctl PR_SET_PDEATHSIG); a
    watchdog thread covers other systems and the race where the parent died before the prctl."""
    if sys.platform.startswith("linux"):
        try:
            import ctypes

            ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG = 1
        except (OSError, AttributeError):
            pass

    def watch() -> None:
        while True:
            if os.getppid() != parent_pid:
                os.kill(os.getpid(), signal.SIGKILL)
            time.sleep(0.5)

    threading.Thread(target=watch, name="flashsys-parent-watchdog", daemon=True).start()


def _spawn_entry(rank, fn, world_size, backend, timeout_s, args, parent_pid, launch_dir):
    _die_with_parent(parent_pid)

    def report(e: BaseException) -> None:
        Path(launch_dir, f"rank{rank}.json").write_text(json.dumps(
            {"rank": rank, "type": type(e).__name__, "message": str(e), "traceback": traceback.format_exc(),
             "time": time.time()}))

    try:
        device = _join(rank, world_size, backend, timeout_s,
                       store=_rendezvous_store(rank, world_size, launch_dir, timeout_s))
    except BaseException as e:
        report(e)
        raise
    try:
        fn(rank, world_size, device, *args)
        # A sender may finish its last collective before its peers have received everything; closing the
        # connections then would abort them. Meet once more before tearing down.
        if dist.is_initialized():
            dist.barrier()
    except BaseException as e:
        report(e)  # before shutdown(): closing the connections is what makes the peers fail in turn
        raise
    finally:
        shutdown()


def spawn(
    fn: Callable[..., Any], world_size: int, *args: Any, backend: str | None = None,
    timeout_s: float = DEFAULT_TIMEOUT_S,
) -> None:
    """Run fn(rank, world_size, device, *args) in world_size processes joined in one process group.

    Rank 0 binds a port the kernel picks, at bind time, and tells the others through a temporary file, so
    concurrent launches on one machine cannot take each other's port. Each process is torn down with `shutdown()`
    after fn returns, and ends if the launching process ends.

    Args:
        fn: a picklable (module-level) function.
        world_size: number of processes.
        *args: passed to fn after (rank, world_size, device); must be picklable.
        backend: "nccl" or "gloo" (default: NCCL when CUDA is available).
        timeout_s: the process group's collective timeout: a rank that waits longer fails.

    Raises:
        ValueError: for world_size < 1, or more NCCL ranks than GPUs.
        SpawnError: when any rank fails, naming each rank's own exception, the first failure first.
    """
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    backend = backend or default_backend()
    if backend == "nccl" and world_size > torch.cuda.device_count():
        raise ValueError(f"world_size {world_size} > {torch.cuda.device_count()} CUDA devices for NCCL")
    # One temporary directory carries the rendezvous port and each failing rank's report.
    with tempfile.TemporaryDirectory(prefix="flashsys-spawn-") as launch_dir:
        try:
            mp.spawn(_spawn_entry, args=(fn, world_size, backend, timeout_s, args, os.getpid(), launch_dir),
                     nprocs=world_size, join=True)
        except (mp.ProcessRaisedException, mp.ProcessExitedException) as e:
            # mp.spawn has terminated and joined the other ranks: the reports written are all there will be.
            failures = []
            for path in Path(launch_dir).glob("rank*.json"):
                try:
                    failures.append(json.loads(path.read_text()))
                except (OSError, ValueError):
                    pass
            failures.sort(key=lambda f: f["time"])
            raise SpawnError(failures, world_size, e) from None
