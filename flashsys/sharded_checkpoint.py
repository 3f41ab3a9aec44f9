"""Sharded training checkpoints through `torch.distributed.checkpoint` (DCP): every rank writes the weights and
optimizer state it holds to its own file, in parallel, and a run resumes from them on any world size and under any
strategy (one rank, DDP, ZeRO-1, ZeRO-2, ZeRO-3); `flashsys convert` turns one into the one-file checkpoint
(`checkpoint.pt`, `flashsys.checkpoint`) and back.

A sharded checkpoint is a directory (`checkpoint/` in the run's output) holding

- DCP's files: `.metadata` and one `__<rank>_<n>.distcp` per writing rank;
- `flashsys.json`, the manifest: the step, loss history and run record (what the one-file checkpoint holds beside
  the tensors), each parameter's name and shape, the optimizer's param groups, the key and range of every piece,
  the 0-d optimizer states (Adam's step), and the SHA-256 of every file and of the manifest's own body.

The unit of storage is a *piece*: elements [start, end) of a flattened parameter, or of one of its per-element
optimizer states (exp_avg, ...), under the key `w/<index>@<start>:<end>` or `s/<index>/<name>@<start>:<end>`
(index: the parameter's position in the optimizer's groups, as optimizer state dicts number them). Pieces do not
depend on the strategy that wrote them, which is what lets every strategy read every checkpoint:

    strategy        a rank writes                                   a rank reads
    one rank, DDP   whole parameters, by index modulo the world     everything
    ZeRO-1          the parameters it owns, whole                   all weights; its parameters' state
    ZeRO-2          its slice of every bucket (contiguous ranges)   all weights; its slices' state
    ZeRO-3 (FSDP2)  its block of rows of every parameter            its rows' weights and state

A reader asks DCP for the stored pieces that overlap the ranges it holds and copies the overlaps in. A checkpoint
replaces the previous one only once complete: it is written to `checkpoint.tmp/` and renamed.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import math
import os
import shutil
import warnings
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from .checkpoint import check_continuation, progress_problem, sha256_of_file
from .errors import UsageError

SHARDED_CHECKPOINT = "checkpoint"  # the directory's name in a run's output
MANIFEST = "flashsys.json"
FORMAT = "flashsys-sharded-checkpoint 1"


@dataclass
class Piece:
    """Elements [start, end) of parameter `index` (flattened) and of its per-element optimizer states, as one rank
    holds them; `state` also holds the parameter's 0-d states (the same on every piece)."""

    index: int
    start: int
    end: int
    weight: torch.Tensor
    state: dict[str, torch.Tensor]


# ---------------------------------------------------------------------------------------------------- what a rank holds
def ordered_parameters(model: nn.Module, opt: torch.optim.Optimizer) -> list[tuple[str, nn.Parameter]]:
    """(name in `model`, parameter) in the order of the optimizer's groups: the index pieces are stored under."""
    names = {id(p): n for n, p in model.named_parameters()}
    return [(names[id(p)], p) for g in opt.param_groups for p in g["params"]]


def _row_block(p: torch.Tensor) -> tuple[int, torch.Tensor]:
    """(first flat element, local tensor) of a parameter sharded by FSDP2 (a DTensor split along dim 0)."""
    from torch.distributed.tensor import Shard
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    if tuple(p.placements) != (Shard(0),):
        raise ValueError(f"sharded checkpoints take FSDP2 parameters sharded along dim 0, got {p.placements}")
    _, offset = compute_local_shape_and_global_offset(p.shape, p.device_mesh, p.placements)
    return offset[0] * math.prod(p.shape[1:]), p.to_local()


def _flat_states(values: dict[str, Any], n: int, owner: str) -> dict[str, torch.Tensor]:
    """A piece's optimizer states: per-element ones flattened (n elements), 0-d ones as they are."""
    from torch.distributed.tensor import DTensor

    out = {}
    for name, v in values.items():
        if isinstance(v, DTensor):
            v = v.to_local()
        if not torch.is_tensor(v) or (v.dim() > 0 and v.numel() != n):
            raise ValueError(f"sharded checkpoints hold 0-d and per-element tensor optimizer states; {owner}'s "
                             f"{name!r} is {type(v).__name__}{'' if not torch.is_tensor(v) else tuple(v.shape)}")
        out[name] = v.detach().reshape(-1) if v.dim() > 0 else v.detach()
    return out


def local_pieces(model: nn.Module, opt: torch.optim.Optimizer, strategy: str, rank: int, world: int) -> list[Piece]:
    """The pieces this rank writes under `strategy` ("single", "ddp", "zero1", "zero2", "zero3"; the table above):
    together the ranks' pieces hold every element of every parameter exactly once."""
    params = [p for _, p in ordered_parameters(model, opt)]
    if strategy in ("zero1", "zero2"):
        parts = {(part.index, part.start): part.values for part in opt.state_parts()}
        return [Piece(i, s, e, params[i].detach().reshape(-1)[s:e],
                      _flat_states(parts.get((i, s), {}), e - s, f"parameter {i}"))
                for i, s, e in opt.owned_ranges()]
    if strategy == "zero3":
        pieces = []
        for i, p in enumerate(params):
            start, local = _row_block(p)
            if local.numel():
                pieces.append(Piece(i, start, start + local.numel(), local.detach().reshape(-1),
                                    _flat_states(opt.state.get(p, {}), local.numel(), f"parameter {i}")))
        return pieces
    return [Piece(i, 0, p.numel(), p.detach().reshape(-1), _flat_states(opt.state.get(p, {}), p.numel(),
                                                                          f"parameter {i}"))
            for i, p in enumerate(params) if i % world == rank]


# ---------------------------------------------------------------------------------------------------------- writing
def _body_digest(body: dict) -> str:
    return hashlib.sha256(json.dumps(body, sort_keys=True).encode()).hexdigest()


def _distributed() -> bool:
    return dist.is_available() and dist.is_initialized()


@contextlib.contextmanager
def _one_process_quietly() -> Iterator[None]:
    """DCP warns that it assumes a single process when there is no process group: that is the intent here."""
    with warnings.catch_warnings():
        if not _distributed():
            warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        yield


def save_sharded_checkpoint(directory: Path, pieces: list[Piece], params: list[tuple[str, tuple[int, ...]]],
                            param_groups: list[dict[str, Any]], step: int, history: list, config: dict) -> None:
    """Write this rank's `pieces` and, on rank 0, the manifest; then the checkpoint replaces `directory`'s.
    A collective over the default process group when there is one (every rank calls it with its own pieces and the
    same other arguments); without one this process writes the whole checkpoint.

    params: (name, shape) of every parameter, by index; param_groups: the optimizer's groups in the index layout
    (`torch.optim.Optimizer.state_dict()["param_groups"]`); step, history, config: as the one-file checkpoint.
    """
    import torch.distributed.checkpoint as dcp

    distributed = _distributed()
    rank = dist.get_rank() if distributed else 0
    tmp = directory.with_name(directory.name + ".tmp")
    if rank == 0:
        shutil.rmtree(tmp, ignore_errors=True)  # a write that died half-way
        tmp.mkdir(parents=True)
    if distributed:
        dist.barrier()
    tensors: dict[str, torch.Tensor] = {}
    where: list[list] = []  # [key, index, state name ("" for the weight), start, end]
    scalars: list[list] = []  # [index, state name, value, dtype]
    for x in pieces:
        key = f"w/{x.index}@{x.start}:{x.end}"
        tensors[key] = x.weight
        where.append([key, x.index, "", x.start, x.end])
        for name, v in x.state.items():
            if v.dim() == 0:
                if x.start == 0:  # the one piece that holds element 0 records the parameter's 0-d states
                    scalars.append([x.index, name, v.item(), str(v.dtype).removeprefix("torch.")])
                continue
            key = f"s/{x.index}/{name}@{x.start}:{x.end}"
            tensors[key] = v
            where.append([key, x.index, name, x.start, x.end])
    with _one_process_quietly():
        dcp.save(tensors, storage_writer=dcp.FileSystemWriter(str(tmp)), no_dist=not distributed)
    mine = (where, scalars, {f.name: sha256_of_file(f) for f in sorted(tmp.glob(f"__{rank}_*.distcp"))})
    gathered = [None] * dist.get_world_size() if distributed and rank == 0 else [mine]
    if distributed:
        dist.gather_object(mine, gathered if rank == 0 else None, dst=0)
    if rank == 0:
        body = {
            "step": step, "history": [list(h) for h in history], "config": config,
            "params": [[name, list(shape)] for name, shape in params], "param_groups": param_groups,
            "pieces": sorted(w for g in gathered for w in g[0]),
            "scalars": sorted(s for g in gathered for s in g[1]),
            "files": {**{n: d for g in gathered for n, d in g[2].items()}, ".metadata": sha256_of_file(tmp / ".metadata")},
        }
        with open(tmp / MANIFEST, "w") as f:
            json.dump({"format": FORMAT, "body_sha256": _body_digest(body), "body": body}, f)
            f.flush()
            os.fsync(f.fileno())
        old = directory.with_name(directory.name + ".old")
        shutil.rmtree(old, ignore_errors=True)
        if directory.exists():
            os.replace(directory, old)
        os.replace(tmp, directory)  # from here on the new checkpoint is the one a resume finds
        shutil.rmtree(old, ignore_errors=True)
    if distributed:
        dist.barrier()


def save_from_training(directory: Path, model: nn.Module, opt: torch.optim.Optimizer, strategy: str, step: int,
                       history: list, config: dict) -> None:
    """`save_sharded_checkpoint` of a training rank's model and optimizer (a collective)."""
    from .optim.state_dicts import indexed_param_groups

    rank, world = (dist.get_rank(), dist.get_world_size()) if _distributed() else (0, 1)
    named = ordered_parameters(model, opt)
    save_sharded_checkpoint(directory, local_pieces(model, opt, strategy, rank, world),
                            [(n, tuple(p.shape)) for n, p in named], _jsonable(indexed_param_groups(opt.param_groups)),
                            step, history, config)


def _jsonable(groups: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Param groups with tuples as lists and tensors (a tensor lr) as numbers, as JSON holds them."""
    def plain(v):
        if torch.is_tensor(v):
            return v.item()
        return list(v) if isinstance(v, tuple) else v
    return [{k: plain(v) for k, v in g.items()} for g in groups]


# ---------------------------------------------------------------------------------------------------------- reading
def find_directory(directory: Path) -> Path | None:
    """The checkpoint directory to read: `directory`, or the previous checkpoint kept aside while a new one was being
    moved into place (a run killed between the two renames); None when neither exists."""
    if (directory / MANIFEST).is_file():
        return directory
    old = directory.with_name(directory.name + ".old")
    if not directory.exists() and (old / MANIFEST).is_file():
        return old
    return directory if directory.exists() else None


def read_manifest(directory: Path, verify_files: bool = True) -> dict:
    """The checked manifest body of the sharded checkpoint in `directory`: every file it lists present (and, with
    `verify_files`, with its recorded SHA-256), every parameter's weights and states covered by pieces exactly once,
    and contents a run could have written.

    Raises:
        UsageError: naming what is missing, damaged or inconsistent.
    """
    path = directory / MANIFEST
    try:
        doc = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise UsageError(f"{directory} is not a readable sharded checkpoint ({MANIFEST}: "
                         f"{type(e).__name__})") from None
    if not isinstance(doc, dict) or doc.get("format") != FORMAT or not isinstance(doc.get("body"), dict):
        raise UsageError(f"{path} is not a flashsys sharded-checkpoint manifest")
    body = doc["body"]
    if _body_digest(body) != doc.get("body_sha256"):
        raise UsageError(f"{path} is corrupted (checksum mismatch)")
    missing = sorted(name for name in body["files"] if not (directory / name).is_file())
    if missing:
        raise UsageError(f"the sharded checkpoint {directory} lacks {', '.join(missing)}: shards are "
                         "missing (copied in part?). Use a complete copy, or start again.")
    if verify_files:
        bad = verify_my_share(directory, body, 0, 1)
        if bad:
            raise UsageError(f"{', '.join(bad)} in {directory} do not match the manifest (damaged, or "
                             "from another checkpoint). Use another copy, or start again.")
    problem = _manifest_problem(body)
    if problem:
        raise UsageError(f"the sharded checkpoint {directory} is inconsistent ({problem}); it was not "
                         "written by a flashsys run as it stands. Use another copy, or start again.")
    return body


def _manifest_problem(body: dict) -> str | None:
    """What makes a manifest's contents unusable, or None."""
    step, history, params = body["step"], body["history"], body["params"]
    spans: dict[tuple[int, str], list[tuple[int, int]]] = {}
    for _, index, name, start, end in body["pieces"]:
        spans.setdefault((index, name), []).append((start, end))
    for (index, name), ranges in spans.items():
        covered, numel = 0, math.prod(params[index][1])
        for start, end in sorted(ranges):
            if start != covered:
                return f"elements {covered}-{start} of parameter {index}'s {name or 'weights'} are in no shard"
            covered = end
        if covered != numel:
            return f"elements {covered}-{numel} of parameter {index}'s {name or 'weights'} are in no shard"
    no_weights = [i for i in range(len(params)) if (i, "") not in spans]
    if no_weights:
        return f"no weights for parameters {no_weights}"
    steps_taken = {float(value) for _, name, value, _ in body["scalars"] if name == "step"}
    with_state = {index for index, name in spans if name} | {s[0] for s in body["scalars"]}
    return progress_problem(step, history, len(with_state), len(params), steps_taken)


def read_for_resume(directory: Path, config: dict, force: bool = False, verify_files: bool = True) -> dict:
    """`read_manifest`, then `check_continuation` against the run about to resume (a TrainConfig as a dict)."""
    body = read_manifest(directory, verify_files)
    check_continuation(body["config"], body["step"], config, force)
    return body


def verify_my_share(directory: Path, body: dict, rank: int, world: int) -> list[str]:
    """The files among every world-th (from `rank`) whose SHA-256 differs from the manifest's: the ranks of a run
    share the reading of a checkpoint's bytes."""
    names = sorted(body["files"])
    return [n for n in names[rank::world] if sha256_of_file(directory / n) != body["files"][n]]


def read_ranges(directory: Path, body: dict, wanted: list[tuple[int, str, int, int]]) -> dict[tuple, torch.Tensor]:
    """Elements [start, end) of parameter index's weights (name "") or state `name`, for each (index, name, start,
    end) in `wanted`, as flat CPU tensors keyed by that tuple. Reads only the stored pieces that overlap them. A
    collective when there is a process group (every rank calls it, each with its own `wanted`)."""
    import torch.distributed.checkpoint as dcp

    stored: dict[tuple[int, str], list[tuple[int, int, str]]] = {}
    for key, index, name, start, end in body["pieces"]:
        stored.setdefault((index, name), []).append((start, end, key))
    reader = dcp.FileSystemReader(str(directory))
    meta = reader.read_metadata().state_dict_metadata
    needed: dict[str, torch.Tensor] = {}
    plan = []
    for index, name, start, end in wanted:
        overlaps = [(s, e, key) for s, e, key in stored.get((index, name), ()) if s < end and start < e]
        for _, _, key in overlaps:
            if key not in needed:
                needed[key] = torch.empty(meta[key].size, dtype=meta[key].properties.dtype)
        plan.append(((index, name, start, end), overlaps))
    with _one_process_quietly():
        dcp.load(needed, storage_reader=reader, no_dist=not _distributed())
    out = {}
    for (index, name, start, end), overlaps in plan:
        flat = torch.empty(end - start, dtype=needed[overlaps[0][2]].dtype) if overlaps else torch.empty(0)
        for s, e, key in overlaps:
            lo, hi = max(s, start), min(e, end)
            flat[lo - start:hi - start] = needed[key][lo - s:hi - s]
        out[(index, name, start, end)] = flat
    return out


def _dtype(name: str) -> torch.dtype:
    return getattr(torch, name)


def _state_names(body: dict) -> dict[int, set[str]]:
    names: dict[int, set[str]] = {}
    for _, index, name, _, _ in body["pieces"]:
        if name:
            names.setdefault(index, set()).add(name)
    return names


def _groups(body: dict) -> list[dict[str, Any]]:
    """The manifest's param groups with lists turned back into tuples (betas), as optimizers keep them."""
    return [{k: (tuple(v) if isinstance(v, list) and k != "params" else v) for k, v in g.items()}
            for g in body["param_groups"]]


def load_into_training(directory: Path, body: dict, model: nn.Module, opt: torch.optim.Optimizer,
                       strategy: str) -> None:
    """Load the sharded checkpoint into a training rank's model and optimizer, whatever strategy and world size
    wrote it (a collective): each rank reads the ranges it holds (the table in the module's docstring).

    Raises:
        UsageError: when the checkpoint's parameters are not this model's.
    """
    named = ordered_parameters(model, opt)
    mine = [[n, list(p.shape)] for n, p in named]
    if mine != body["params"]:
        raise UsageError(f"--resume: the sharded checkpoint holds parameters {body['params'][:3]}..., this model "
                         f"{mine[:3]}... ({len(body['params'])} and {len(mine)})")
    params = [p for _, p in named]
    states = _state_names(body)
    scalars: dict[int, dict[str, torch.Tensor]] = {}
    for index, name, value, dtype in body["scalars"]:
        scalars.setdefault(index, {})[name] = torch.tensor(value, dtype=_dtype(dtype))
    if strategy == "zero3":
        blocks = {i: _row_block(p) for i, p in enumerate(params)}
        weight_ranges = {i: (s, s + local.numel()) for i, (s, local) in blocks.items()}
        state_ranges = [(i, s, e) for i, (s, e) in weight_ranges.items()]
    else:
        weight_ranges = {i: (0, p.numel()) for i, p in enumerate(params)}
        state_ranges = (opt.owned_ranges() if strategy in ("zero1", "zero2")
                        else [(i, 0, p.numel()) for i, p in enumerate(params)])
    wanted = [(i, "", s, e) for i, (s, e) in weight_ranges.items()]
    wanted += [(i, name, s, e) for i, s, e in state_ranges for name in sorted(states.get(i, ()))]
    got = read_ranges(directory, body, wanted)
    with torch.no_grad():
        for i, p in enumerate(params):
            s, e = weight_ranges[i]
            target = blocks[i][1] if strategy == "zero3" else p
            target.copy_(got[(i, "", s, e)].view(target.shape))
    state: dict[int, dict[str, Any]] = {}
    if strategy == "zero3":
        from torch.distributed.tensor import DTensor

        for i, s, e in state_ranges:
            p, local = params[i], blocks[i][1]
            values = {name: DTensor.from_local(got[(i, name, s, e)].view(local.shape).to(local.device),
                                               p.device_mesh, p.placements, shape=p.shape, stride=p.stride())
                      for name in states.get(i, ())}
            if values or i in scalars:
                state[i] = {**scalars.get(i, {}), **values}
    else:
        for i, s, e in state_ranges:
            if not states.get(i) and i not in scalars:
                continue
            entry = state.setdefault(i, dict(scalars.get(i, {})))
            for name in states.get(i, ()):
                full = entry.get(name)
                if full is None:
                    full = entry[name] = torch.zeros(params[i].shape, dtype=got[(i, name, s, e)].dtype)
                full.view(-1)[s:e] = got[(i, name, s, e)]
    opt.load_state_dict({"state": state, "param_groups": _groups(body)})


# -------------------------------------------------------------------------------------------------------- converting
def to_single_file(directory: Path, path: Path) -> None:
    """Write the sharded checkpoint in `directory` as the one-file checkpoint `path` (read by one process; its
    memory holds the whole checkpoint once).

    Raises:
        UsageError: when the sharded checkpoint is missing, damaged or inconsistent.
    """
    from .checkpoint import save_checkpoint_atomically

    body = read_manifest(directory)
    params = body["params"]
    states = _state_names(body)
    wanted = [(i, name, 0, math.prod(shape)) for i, (_, shape) in enumerate(params)
              for name in ["", *sorted(states.get(i, ()))]]
    got = read_ranges(directory, body, wanted)
    model = {name: got[(i, "", 0, math.prod(shape))].view(shape) for i, (name, shape) in enumerate(params)}
    state: dict[int, dict[str, Any]] = {}
    for index, name, value, dtype in body["scalars"]:
        state.setdefault(index, {})[name] = torch.tensor(value, dtype=_dtype(dtype))
    for i, (_, shape) in enumerate(params):
        for name in sorted(states.get(i, ())):
            state.setdefault(i, {})[name] = got[(i, name, 0, math.prod(shape))].view(shape)
    save_checkpoint_atomically({"model": model, "optimizer": {"state": dict(sorted(state.items())),
                                                             "param_groups": _groups(body)},
                                "step": body["step"], "history": [tuple(h) for h in body["history"]],
                                "config": body["config"]}, path)


def from_single_file(path: Path, directory: Path) -> None:
    """Write the one-file checkpoint `path` as a sharded checkpoint in `directory` (one process, one shard).

    Raises:
        UsageError: when the checkpoint is missing, damaged, or its optimizer state does not follow its weights.
    """
    from .checkpoint import load_checkpoint

    ckpt = load_checkpoint(path)
    model, opt = ckpt["model"], ckpt["optimizer"]
    n = sum(len(g["params"]) for g in opt["param_groups"])
    if n != len(model):
        raise UsageError(f"{path}: the optimizer state covers {n} parameters, the model has {len(model)} tensors")
    pieces = [Piece(i, 0, t.numel(), t.reshape(-1), _flat_states(opt["state"].get(i, {}), t.numel(), name))
              for i, (name, t) in enumerate(model.items())]
    save_sharded_checkpoint(directory, pieces, [(name, tuple(t.shape)) for name, t in model.items()],
                            _jsonable(opt["param_groups"]), ckpt["step"], ckpt["history"], ckpt["config"])
