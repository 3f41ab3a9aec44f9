"""What a launch needs to know of its GPU: the SMs this process may run programs on at once, the shared memory one
program may take, and the L2 cache they share. The one place that reads them, once per device: reading a device's
properties costs host time, and a decode step makes a launch per layer."""

from __future__ import annotations

import functools
import os

import torch
import triton

__all__ = ["l2_cache_bytes", "max_shared_memory", "usable_sms"]


def _index(device: torch.device) -> int:
    return device.index if device.index is not None else torch.cuda.current_device()


@functools.lru_cache(maxsize=None)
def _sm_count(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


@functools.lru_cache(maxsize=None)
def _l2_bytes(index: int) -> int:
    return int(getattr(torch.cuda.get_device_properties(index), "L2_cache_size", 0))


@functools.lru_cache(maxsize=None)
def _shared_memory(index: int) -> int:
    return triton.runtime.driver.active.utils.get_device_properties(index)["max_shared_mem"]


def usable_sms(device: torch.device, stand_in: int | None = None) -> int:
    """The SMs of `device` this process's kernels can run on at once: its count, cut to MPS's share where
    CUDA_MPS_ACTIVE_THREAD_PERCENTAGE limits it (read on every call: a process may set it after its first launch; an
    unreadable share counts as the smallest, one SM). `stand_in`: the count to assume on a device that is not a GPU
    (compiling or interpreting without one); such a device without it is an error."""
    if device.type == "cuda":
        sms = _sm_count(_index(device))
    elif stand_in is not None:
        sms = stand_in
    else:
        raise ValueError(f"usable_sms: {device} is not a CUDA device, and no stand-in SM count was given")
    share = os.environ.get("CUDA_MPS_ACTIVE_THREAD_PERCENTAGE")
    try:
        return sms if share is None else max(1, int(sms * float(share) / 100))
    except ValueError:
        return 1


def max_shared_memory(device: torch.device) -> int:
    """The most shared memory, in bytes, one program may take on a CUDA device (sm_90: 232,448; sm_86/89: 101,376),
    as Triton's driver reports it."""
    return _shared_memory(_index(device))


def l2_cache_bytes(device: torch.device, stand_in: int | None = None) -> int:
    """The L2 cache of `device` in bytes (50 MiB on an H100). `stand_in`: the size to assume on a device that is not
    a GPU (compiling or interpreting without one), or where torch does not report it; such a device without it is an
    error."""
    size = _l2_bytes(_index(device)) if device.type == "cuda" else 0
    if size:
        return size
    if stand_in is None:
        raise ValueError(f"l2_cache_bytes: no L2 size for {device}, and no stand-in was given")
    return stand_in
