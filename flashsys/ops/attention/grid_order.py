"""The order in which the attention kernels' programs run: one number for the launchers, read by both kernel files.

Every kernel's grid is 1-D over (tile, batch * head). The GPU starts programs in index order, and the kernels
(`flash_triton._program_start`, `gluon_kernels._grid_position`) map indices so that the (batch, head) pairs run in
groups of about `group_programs` programs, one group after another, tile by tile within a group. Causal tiles
differ in work; tile by tile, a group's heaviest tiles start first and its short ones fill the tail. Groups keep
the K/V that the programs running at once read to a few heads, which L2 holds (kernel_experiments.md).
"""

from __future__ import annotations

import functools

import torch

# Programs to a head group, per SM.
GROUP_PROGRAMS_PER_SM = 4


@functools.lru_cache(maxsize=None)
def group_programs(device: torch.device) -> int:
    """How many programs a head group spans on `device`. Under the interpreter the order only orders programs; the
    small groups there make the CPU tests run several groups, the last one partial."""
    if device.type != "cuda":
        return GROUP_PROGRAMS_PER_SM
    return GROUP_PROGRAMS_PER_SM * torch.cuda.get_device_properties(device).multi_processor_count
