"""device_limits: the one place launches read their GPU's SM count, shared-memory limit and L2 size. Checked without
a GPU: the device reads are replaced, the rules around them (MPS's share, stand-ins, which device index) are real."""

from __future__ import annotations

import pytest
import torch

from flashsys.ops.attention import device_limits
from flashsys.ops.attention.gluon import launch as gluon_launch
from flashsys.ops.attention.triton import decode


@pytest.fixture
def h100(monkeypatch):
    """Device reads answered as an H100's (132 SMs, 232,448 bytes, 50 MiB of L2), recording the device indices asked
    for."""
    asked = []
    monkeypatch.setattr(device_limits, "_sm_count", lambda index: asked.append(index) or 132)
    monkeypatch.setattr(device_limits, "_shared_memory", lambda index: asked.append(index) or 232_448)
    monkeypatch.setattr(device_limits, "_l2_bytes", lambda index: asked.append(index) or 50 << 20)
    monkeypatch.delenv("CUDA_MPS_ACTIVE_THREAD_PERCENTAGE", raising=False)
    return asked


def test_a_gpu_gives_its_sm_count_and_shared_memory_for_its_own_index(h100):
    assert device_limits.usable_sms(torch.device("cuda", 1)) == 132
    assert device_limits.max_shared_memory(torch.device("cuda", 1)) == 232_448
    assert device_limits.l2_cache_bytes(torch.device("cuda", 1)) == 50 << 20
    assert h100 == [1, 1, 1]


@pytest.mark.parametrize("share, sms", [("50", 66), ("12.5", 16), ("0.1", 1), ("most", 1)])
def test_mps_share_cuts_the_sms_and_an_unreadable_one_counts_as_one(h100, monkeypatch, share, sms):
    monkeypatch.setenv("CUDA_MPS_ACTIVE_THREAD_PERCENTAGE", share)
    assert device_limits.usable_sms(torch.device("cuda", 0)) == sms


def test_a_cpu_takes_the_callers_stand_in_and_refuses_without_one(h100):
    assert device_limits.usable_sms(torch.device("cpu"), stand_in=4) == 4
    with pytest.raises(ValueError, match="not a CUDA device"):
        device_limits.usable_sms(torch.device("cpu"))
    assert device_limits.l2_cache_bytes(torch.device("cpu"), stand_in=1 << 20) == 1 << 20
    with pytest.raises(ValueError, match="no L2 size"):
        device_limits.l2_cache_bytes(torch.device("cpu"))
    assert h100 == []  # no device read for a CPU


def test_a_gpu_whose_l2_size_torch_does_not_report_takes_the_stand_in(h100, monkeypatch):
    monkeypatch.setattr(device_limits, "_l2_bytes", lambda index: 0)
    assert device_limits.l2_cache_bytes(torch.device("cuda", 0), stand_in=1 << 20) == 1 << 20
    with pytest.raises(ValueError, match="no L2 size"):
        device_limits.l2_cache_bytes(torch.device("cuda", 0))


def test_decode_and_the_gluon_launches_read_the_same_limits(h100, monkeypatch):
    cuda = torch.device("cuda", 0)
    assert decode.program_target(cuda) == 132 and decode.shared_limit(cuda) == 232_448
    assert decode.program_target(torch.device("cpu")) == decode.CPU_PROGRAMS
    assert gluon_launch.usable_sms(torch.empty(1)) == 132  # a CPU tensor: an H100 stands in
    monkeypatch.setenv("CUDA_MPS_ACTIVE_THREAD_PERCENTAGE", "50")
    assert decode.program_target(cuda) == 66  # decoding used to ignore MPS's share
    assert gluon_launch.usable_sms(torch.empty(1)) == 66
