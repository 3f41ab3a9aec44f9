"""Will it fit, and what will it cost? A training configuration's memory per rank, bytes communicated per step and
predicted step time, from its shapes alone, for each data-parallel strategy flashsys trains with.

The accounting is the trainer's: fp32 master weights and gradients, AdamW's two fp32 moments, activations in the
compute dtype (bf16 under autocast), and the buffers each strategy adds:

| strategy | params | grads | optimizer | buffers | communication per step (ring) |
|---|---|---|---|---|---|
| ddp (`BucketedDDP`, bucket views) | P | G | O | — | all-reduce of G |
| zero1 (`ShardedOptimizer`) | P | G | O / N | a broadcast chunk (128 MB) | all-reduce of G, broadcast of P |
| zero2 (`ZeRO2Optimizer`) | P | G / N | O / N | the buckets in flight | reduce-scatter of G, all-gather of P |
| zero3 (FSDP2, bf16) | P / N | G / N | O / N | 2 blocks, bf16 | 2 bf16 all-gathers of P, reduce-scatter of G |

with P = G = 4 bytes per parameter and O = 8. Activations are those backward keeps, counted per token and layer from
the blocks' saved tensors (see `activation_bytes`); with activation checkpointing only each block's input is kept,
plus one block's activations while it is recomputed.

The step time is a prediction, not a measurement: compute at an assumed fraction of the device's peak FLOP/s (the
model FLOPs of `flashsys.mfu`), communication at a link bandwidth (the all-reduce bus bandwidth measured in
`benchmarks/results/allreduce/`, or given), overlapped with the backward except for one bucket's (one block's)
share, which is exposed.
"""

from __future__ import annotations

import csv
from dataclasses import dataclass, field
from pathlib import Path

from .mfu import PEAK_FLOPS, model_flops_per_token
from .nn.config import ModelConfig

STRATEGIES = ("ddp", "zero1", "zero2", "zero3")
# What `flashsys train` runs (--no-shard, --zero-stage 1, 2 and 3).
TRAINER_STRATEGIES = STRATEGIES
GiB = 2**30
BROADCAST_CHUNK = 128 * 2**20  # ShardedOptimizer.broadcast_chunk_bytes
BUCKET_BYTES = 256 * 2**20  # a typical "auto" bucket (docs/data-parallel.md): what ZeRO-2 holds while it reduces
# The fraction of peak FLOP/s a step reaches by default: the xl preset's compute-only step on an H200
# (benchmarks/results/ddp/: 332.5 ms, MFU 0.308).
DEFAULT_EFFICIENCY = 0.31
ALLREDUCE_TABLE = Path(__file__).resolve().parent.parent / "benchmarks" / "results" / "allreduce" / "allreduce_nccl.csv"


@dataclass(frozen=True)
class Device:
    """What the plan needs of a device: memory, dense peak FLOP/s per dtype, and a link bandwidth (bytes/s of an
    all-reduce's bus bandwidth; None: read the measured table)."""

    name: str
    memory: float
    peak_flops: dict[str, float]
    link_bandwidth: float | None = None


DEVICES = {
    "h100": Device("H100 80GB", 80 * 10**9, PEAK_FLOPS["H100"]),
    "h200": Device("H200", 141 * 10**9, PEAK_FLOPS["H200"]),
    "a100": Device("A100 80GB", 80 * 10**9, PEAK_FLOPS["A100"]),
    "v5p": Device("TPU v5p", 95 * 10**9, {"bfloat16": 459e12, "float32": 459e12 / 4}),
}


@dataclass(frozen=True)
class Memory:
    """Bytes one rank holds at its peak, by kind."""

    parameters: float
    gradients: float
    optimizer: float
    activations: float
    buffers: float

    @property
    def total(self) -> float:
        """Every category's bytes together."""
        return self.parameters + self.gradients + self.optimizer + self.activations + self.buffers


@dataclass(frozen=True)
class Plan:
    """One strategy's accounting for a configuration. `floor` is the memory no run of it can stay under (its state
    and `activation_floor_bytes`)."""

    strategy: str
    world: int
    memory: Memory
    fits: bool
    floor: float
    comm_bytes: float  # bytes each rank sends per step
    compute_s: float
    comm_s: float
    step_s: float
    notes: list[str] = field(default_factory=list)


def parameter_count(c: ModelConfig) -> int:
    """Every parameter of `TransformerLM(c)`: embeddings, blocks (attention, SwiGLU, two RMSNorms), final norm,
    LM head (untied)."""
    kv_width = c.head_dim * (c.num_kv_heads or c.num_heads)
    block = 2 * c.d_model**2 + 2 * c.d_model * kv_width + 3 * c.d_model * c.d_ff + 2 * c.d_model
    return c.num_layers * block + 2 * c.vocab_size * c.d_model + c.d_model


def block_parameter_count(c: ModelConfig) -> int:
    """The parameters of one transformer block of `TransformerLM(c)` (attention, SwiGLU, two RMSNorms)."""
    return (parameter_count(c) - 2 * c.vocab_size * c.d_model - c.d_model) // max(c.num_layers, 1)


def activation_bytes(c: ModelConfig, tokens: int, dtype: str, checkpointing: bool,
                     weight_copies: bool = True) -> float:
    """Bytes backward keeps for `tokens` tokens (batch x context) on one rank.

    Per token and block: the fp32 residual stream into each RMSNorm and its fp32 normalised output, which the
    multiplication by the norm's weight keeps (4 d_model, and their two rsqrt), and in the
    compute dtype the normed inputs of the QKV projection and the SwiGLU (2 d_model), Q, K, V after RoPE and the
    attention output (d_model + 2 kv + d_model; flash attention keeps no N x N scores, only a float32 logsumexp per
    head), and SwiGLU's two projections, their gated product and silu (4 d_ff). Plus the LM head: its logits in the
    compute dtype, their float32 copy (bf16 only) and the float32 log-softmax the loss keeps (vocab each). Under
    bf16 autocast also the bf16 copy of every matmul weight (blocks and LM head), which the matmuls keep for
    backward: 2 bytes per weight, whatever the number of tokens (`weight_copies=False` leaves them out: under
    ZeRO-3 FSDP2 gathers the blocks already in bf16 and frees them after each block, so autocast copies nothing).
    """
    c_bytes = 2 if dtype == "bfloat16" else 4
    kv_width = c.head_dim * (c.num_kv_heads or c.num_heads)
    per_block = (4 * (4 * c.d_model + 2) + c_bytes * (2 * c.d_model + 2 * c.d_model + 2 * kv_width + 4 * c.d_ff)
                 + 4 * c.num_heads)
    head = c.vocab_size * (c_bytes + 4 + (4 if c_bytes == 2 else 0)) + 4 * c.d_model  # fp32: .float() is no copy
    if checkpointing:  # block inputs only, and one block recomputed at a time
        blocks = c.num_layers * 4 * c.d_model + per_block
    else:
        blocks = c.num_layers * per_block
    copies = 2.0 * (parameter_count(c) - c.vocab_size * c.d_model) if c_bytes == 2 and weight_copies else 0.0
    return tokens * (blocks + head) + copies


def activation_floor_bytes(c: ModelConfig, tokens: int, dtype: str, checkpointing: bool) -> float:
    """A lower bound of `activation_bytes`: only tensors backward certainly keeps (each block's fp32 input and its
    Q, K, V and attention output; the loss's float32 log-softmax). What the trainer refuses on: a configuration
    whose state and this floor exceed the device cannot run however the estimate errs."""
    c_bytes = 2 if dtype == "bfloat16" else 4
    per_block = 4 * c.d_model + (0 if checkpointing else c_bytes * 4 * c.d_model)
    return tokens * (c.num_layers * per_block + 4 * c.vocab_size)


def link_bandwidth(world: int, table: Path = ALLREDUCE_TABLE) -> float | None:
    """The all-reduce bus bandwidth (bytes/s) measured at the largest size for `world` ranks (the nearest world size
    measured), or None without a table."""
    try:
        with open(table) as f:
            rows = list(csv.DictReader(f))
    except OSError:
        return None
    rows = [r for r in rows if r.get("busbw_GBps")]
    if not rows:
        return None
    nearest = min({int(r["world_size"]) for r in rows}, key=lambda w: (abs(w - world), -w))
    best = max((r for r in rows if int(r["world_size"]) == nearest), key=lambda r: float(r["size_MB"]))
    return float(best["busbw_GBps"]) * 1e9


def plan(config: ModelConfig, world: int, batch_per_rank: int, strategy: str, device: Device,
         dtype: str = "bfloat16", checkpointing: bool = False, efficiency: float = DEFAULT_EFFICIENCY,
         bandwidth: float | None = None) -> Plan:
    """The accounting of one strategy (see the module's docstring).

    Args:
        config: the model (its context_length is the sequence length trained on).
        world: ranks (one per device).
        batch_per_rank: sequences per rank per step.
        strategy: one of STRATEGIES.
        device: its memory and peak FLOP/s (and link bandwidth, if known).
        dtype: "bfloat16" (autocast, the GPU default) or "float32".
        checkpointing: activation checkpointing of every block.
        efficiency: the fraction of peak FLOP/s the step reaches (the model FLOPs utilisation; default
            `DEFAULT_EFFICIENCY`, measured).
        bandwidth: link bytes/s; default the device's, else the measured all-reduce table's.

    Raises:
        ValueError: for an unknown strategy, a world below 1, or ZeRO-3 on one rank.
    """
    if strategy not in STRATEGIES:
        raise ValueError(f"strategy must be one of {STRATEGIES}, got {strategy!r}")
    if world < 1 or batch_per_rank < 1:
        raise ValueError(f"world and batch per rank must be positive, got {world} and {batch_per_rank}")
    n_params = parameter_count(config)
    p, g, o = 4.0 * n_params, 4.0 * n_params, 8.0 * n_params
    shard = 1.0 / world
    notes = []
    if world == 1:  # one rank: nothing to shard or average; the trainer runs plain AdamW
        memory = Memory(p, g, o, 0.0, 0.0)
        comm = 0.0
        if strategy != "ddp":
            notes.append("one rank: no sharding (the trainer runs the model unwrapped with AdamW)")
    elif strategy == "ddp":
        memory = Memory(p, g, o, 0.0, 0.0)
        comm = 2 * (world - 1) / world * g
    elif strategy == "zero1":
        memory = Memory(p, g, o * shard, 0.0, min(BROADCAST_CHUNK, p))
        comm = 2 * (world - 1) / world * g + (world - 1) / world * p
    elif strategy == "zero2":
        memory = Memory(p, g * shard, o * shard, 0.0, min(2 * BUCKET_BYTES, g))
        comm = (world - 1) / world * (g + p)
    else:
        block_bf16 = 2.0 * block_parameter_count(config)
        memory = Memory(p * shard, g * shard, o * shard, 0.0, 2 * block_bf16 + 2 * config.vocab_size * config.d_model)
        comm = (world - 1) / world * (2 * 2.0 * n_params + g)
    tokens = batch_per_rank * config.context_length
    state = memory.total
    sharded_weights = strategy == "zero3" and world > 1  # FSDP2 gathers them in bf16: autocast copies none
    memory = Memory(memory.parameters, memory.gradients, memory.optimizer,
                    activation_bytes(config, tokens, dtype, checkpointing, weight_copies=not sharded_weights),
                    memory.buffers)
    floor = state + activation_floor_bytes(config, tokens, dtype, checkpointing)
    peak = device.peak_flops.get(dtype) or device.peak_flops["bfloat16"]
    flops = model_flops_per_token(config) * tokens * (4 / 3 if checkpointing else 1)  # + the forward recomputed
    compute_s = flops / (peak * efficiency)
    bw = bandwidth or device.link_bandwidth or link_bandwidth(world)
    if bw is None:
        bw = 300e9
        notes.append("no measured link bandwidth: assumed 300 GB/s")
    comm_s = comm / bw
    # Communication overlaps the backward (buckets) or the neighbouring blocks (ZeRO-3's prefetch), but not the
    # last bucket or block, and ZeRO-1's broadcast follows the step.
    tail = comm / max(config.num_layers, 1) if world > 1 else 0.0
    if strategy == "zero1" and world > 1:
        tail += (world - 1) / world * p
    step_s = max(compute_s, comm_s) + tail / bw
    return Plan(strategy, world, memory, memory.total <= device.memory, floor, comm, compute_s, comm_s, step_s, notes)


# Ties in predicted time go to the strategy with the least communication on the critical path: ZeRO-2 and DDP reduce
# during backward (ZeRO-2 with less memory), ZeRO-1 broadcasts after the step, ZeRO-3 gathers before every block.
# Measured on H200s (xl, benchmarks/results/ddp/): ZeRO-3 as fast as ZeRO-2 at the median but with a wider spread.
PREFERENCE = ("zero2", "ddp", "zero1", "zero3")


def recommend(plans: list[Plan], allowed: tuple[str, ...] = TRAINER_STRATEGIES) -> Plan | None:
    """The fastest predicted of the `allowed` strategies that fits (ties within 1%: `PREFERENCE`), or None."""
    fitting = [p for p in plans if p.fits and p.strategy in allowed]
    if not fitting:
        return None
    fastest = min(p.step_s for p in fitting)
    return min((p for p in fitting if p.step_s <= 1.01 * fastest), key=lambda p: PREFERENCE.index(p.strategy))


def smallest_world(config: ModelConfig, batch_per_rank: int, device: Device, dtype: str, checkpointing: bool,
                   strategies: tuple[str, ...] = STRATEGIES, limit: int = 1 << 16) -> tuple[int, str] | None:
    """(world, strategy) of the fewest devices (powers of two) on which one of `strategies` fits, or None up to
    `limit` devices (the activations of one rank's batch alone exceed the device)."""
    world = 1
    while world <= limit:
        fitting = [s for s in strategies if (world > 1 or s == "ddp")
                   and plan(config, world, batch_per_rank, s, device, dtype, checkpointing).fits]
        if fitting:
            return world, fitting[0]
        world *= 2
    return None


def table(plans: list[Plan]) -> str:
    """The plans as a Markdown table (GiB per rank, GB sent per rank per step, ms)."""
    lines = ["| strategy | params | grads | optimizer | activations | buffers | total GiB/rank | fits | comm GB/step "
             "| compute ms | comm ms | step ms |", "|" + "---|" * 12]
    for p in plans:
        m = p.memory
        lines.append(f"| {p.strategy} | " + " | ".join(f"{x / GiB:,.2f}" for x in (
            m.parameters, m.gradients, m.optimizer, m.activations, m.buffers, m.total))
            + f" | {'yes' if p.fits else 'no'} | {p.comm_bytes / 1e9:,.2f} | {p.compute_s * 1e3:,.1f} | "
            f"{p.comm_s * 1e3:,.1f} | {p.step_s * 1e3:,.1f} |")
    return "\n".join(lines)
