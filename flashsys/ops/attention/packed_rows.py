"""Rows that hold several sequences, or fewer tokens than their length: documents packed in a row, told apart by
their position ids (a document starts wherever a row's positions do not go on by one, how transformers recognises
packed sequences) or by flash-attn's offsets, or real tokens in a padded row, told by a padding mask. `flash_attention_packed` and
`flash_attention_padded` are the entry points; this module finds the sequences and holds the ops both run.

Which rows are packed or padded is known only by reading the positions or the mask back from the device. The
reading makes a *plan*: an int32 tensor holding the sequences' count (0: whole rows, the dense kernels), the longest
one's length, how many tokens are real (0: all of them), the sequences' offsets and the real tokens' indices. An eager
call makes it once per positions or mask tensor (`readback`). A traced call cannot branch on a tensor's values:
Dynamo would break the graph around the reading, in every layer. It calls opaque ops instead, which read and choose
when the graph runs:

- `flashsys::find_documents(position_ids, batch)`, `flashsys::find_offsets(cu_seqlens_q, cu_seqlens_k, batch, n)`
  and `flashsys::find_padding(mask)` read (a wait for the device) and return the plan. Every layer calls one with the same input, so AOTAutograd's common-subexpression pass leaves one
  call per graph: one reading a step, forward and backward together, however many layers share it.
- `flashsys::packed_rows_forward` / `_backward` take the plan and run the dense or the varlen kernels (on the real
  tokens, gathered; pad tokens get O = 0, L = -inf and zero gradients). They learn the plan's counts without
  reading it back: the op that made a plan notes them by its address (only these ops make plans, and they note every
  one, so an address's note is its live plan's).

Every kind of rows gives O, the logsumexp and the gradients one layout, so the graph does not depend on the choice.
The reading waits for the device, so these ops are kept out of CUDA graphs.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch import Tensor

from .flash_torch import (
    flash_backward_torch,
    flash_forward_torch,
    flash_varlen_backward_torch,
    flash_varlen_forward_torch,
)
from .layout import empty_output, heads_inside, laid_out
from .op_library import define_op
from .readback import read_once
from .validation import _shown, refuse_double_backward

Window = tuple[int, int]


class Sequences(NamedTuple):
    """The sequences in a batch of (B, N) rows, as the varlen kernels take them: int32 offsets of each sequence in the
    tokens they run on (ending at their count), the longest sequence's length, and which of the B * N flattened
    tokens those are (None: all of them, documents packed in the rows; else the real tokens of padded rows, in
    order)."""

    cu_seqlens: Tensor
    longest: int
    tokens: Tensor | None


# Each finder reads back once (one wait for the device): the counts first, in one tensor, so that the indices can
# then be gathered at a size known on the host (`nonzero_static`) instead of by `nonzero`, which waits again.


def _find_documents(positions: Tensor) -> Sequences | None:
    batch, n = positions.shape
    starts = torch.ones_like(positions, dtype=torch.bool)
    starts[:, 1:] = positions[:, 1:] - positions[:, :-1] != 1
    starts = starts.reshape(-1)
    index = torch.arange(batch * n, device=positions.device)
    # A token's place in its document: its index less its document's start (the last start at or before it).
    place = index - torch.where(starts, index, 0).cummax(0).values
    count, longest = torch.stack([starts.sum(), place.max() + 1]).tolist()
    if count == batch:  # one start a row: whole rows
        return None
    cu = torch.cat([starts.nonzero_static(size=count).view(-1), index[-1:] + 1]).to(torch.int32)
    return Sequences(cu, longest, None)


def real_runs(mask: Tensor) -> Tensor:
    """(B,) int32: how many runs of real tokens each row of a bool (B, N) padding mask holds (left or right padding:
    one; a row with padding between real tokens: more), on the mask's device."""
    return mask[:, 0].int() + (mask[:, 1:] & ~mask[:, :-1]).sum(1, dtype=torch.int32)


def _find_padding(mask: Tensor) -> Sequences | None:
    mask = mask.bool()
    runs = real_runs(mask)
    lengths = mask.sum(1, dtype=torch.int32)
    most_runs, longest, real = torch.stack([runs.max(), lengths.max(), lengths.sum()]).tolist()
    if most_runs > 1:
        raise ValueError("flash_attention_padded: a row of padding_mask has padding between real tokens; flashsys "
                         "takes left or right padding (one run of real tokens per row)")
    if real == mask.numel():
        return None
    cu = torch.cat([torch.zeros(1, dtype=torch.int32, device=mask.device), lengths.cumsum(0, dtype=torch.int32)])
    return Sequences(cu, longest, mask.reshape(-1).nonzero_static(size=real).view(-1).to(torch.int32))


PLAN_HEADER = 3  # a plan's count of sequences (0: whole rows), longest sequence, real tokens (0: all), then offsets
# (device, address) of each plan made here -> its header. Bounded: a plan whose note was dropped is read back instead.
_plan_notes: dict[tuple[torch.device, int], tuple[int, int, int]] = {}


def plan_size(batch: int, n: int) -> int:
    """A plan's length for `batch` rows of `n` tokens: the header, at most batch * n + 1 offsets, at most batch * n
    real tokens."""
    return PLAN_HEADER + 2 * batch * n + 1


def _plan(found: Sequences | None, batch: int, n: int, device: torch.device) -> Tensor:
    plan = torch.empty(plan_size(batch, n), dtype=torch.int32, device=device)
    if found is None:
        header = (0, 0, 0)
    else:
        header = (found.cu_seqlens.numel() - 1, found.longest, 0 if found.tokens is None else found.tokens.numel())
        plan[PLAN_HEADER:PLAN_HEADER + header[0] + 1].copy_(found.cu_seqlens)
        if found.tokens is not None:
            start = PLAN_HEADER + header[0] + 1
            plan[start:start + header[2]].copy_(found.tokens)
    for i, value in enumerate(header):  # fill_, not `plan[i] = value`: that copies a host tensor in, and waits
        plan[i].fill_(value)
    if len(_plan_notes) > 256:
        _plan_notes.clear()
    _plan_notes[(plan.device, plan.data_ptr())] = header
    return plan


def document_plan(position_ids: Tensor, batch: int) -> Tensor:
    """`flashsys::find_documents`' body: the plan of `batch` rows with these (1 or batch, N) positions."""
    n = position_ids.shape[1]
    return _plan(_find_documents(position_ids.expand(batch, n)), batch, n, position_ids.device)


def padding_plan(mask: Tensor) -> Tensor:
    """`flashsys::find_padding`' body: the plan of rows with this (B, N) padding mask (nonzero: a real token), whose
    real tokens form one run per row.

    Raises:
        ValueError: for a row with padding between real tokens.
    """
    return _plan(_find_padding(mask), *mask.shape, mask.device)


def offsets_plan(cu_seqlens_q: Tensor, cu_seqlens_k: Tensor, batch: int, n: int) -> Tensor:
    """`flashsys::find_offsets`' body: the plan of documents given by flash-attn's offsets into the batch * n
    flattened tokens (any integer dtype), the queries' and the keys' the same.

    Raises:
        ValueError: for offsets that do not start at 0, decrease or end elsewhere than at batch * n, or queries'
            and keys' offsets that differ.
    """
    return _plan(_find_offsets(cu_seqlens_q, cu_seqlens_k, batch, n), batch, n, cu_seqlens_q.device)


def _find_offsets(cu_q: Tensor, cu_k: Tensor, batch: int, n: int) -> Sequences | None:
    values = cu_q.tolist()
    if cu_k.data_ptr() != cu_q.data_ptr() and cu_k.tolist() != values:
        raise ValueError("flash_attention_packed: cu_seqlens_k differs from cu_seqlens_q; with queries and keys at "
                         "the same positions (no cache) each document's keys are its queries")
    steps = [b - a for a, b in zip(values, values[1:])]
    if len(values) < 2 or values[0] != 0 or min(steps) < 0 or values[-1] != batch * n:
        raise ValueError(f"flash_attention_packed: cu_seqlens must start at 0, never decrease and end at the "
                         f"{batch * n} tokens of {batch} rows of {n}, got {_shown(values)}")
    if values == list(range(0, batch * n + 1, n)):
        return None  # a document a row: whole rows
    return Sequences(cu_q.to(torch.int32), max(steps), None)


def find_plan(finder: str, t: Tensor, kind: str, *args) -> Tensor:
    """The plan `flashsys::<finder>(t, *args)` makes: the op itself in a traced call (AOTAutograd merges the layers'
    identical calls into one per graph), else made once per unchanged tensor (`readback`; `kind` as it asks)."""
    op = _FINDERS[finder]
    if torch.compiler.is_compiling():
        return op(t, *args)
    return read_once(t, kind, lambda read: op(read, *args))


def plan_sequences(plan: Tensor) -> Sequences | None:
    """The sequences a plan holds (None: whole rows), from its note, or read back where the note was dropped."""
    count, longest, real = _plan_notes.get((plan.device, plan.data_ptr())) or plan[:PLAN_HEADER].tolist()
    if count == 0:
        return None
    start = PLAN_HEADER + count + 1
    return Sequences(plan[PLAN_HEADER:start], longest, plan[start:start + real] if real else None)


def _flat_tokens(t: Tensor) -> Tensor:
    """(B, H, N, D) as the varlen kernels' (B * N, H, D) tokens: a view where `t` keeps its heads inside its
    sequence dimension (a model's projections), else a copy."""
    return t.transpose(1, 2).reshape(-1, t.shape[1], t.shape[3])


def _as_rows(tokens: Tensor, like: Tensor) -> Tensor:
    """(B * N, H, D) tokens as the (B, H, N, D) tensor shaped like `like`, laid out as `layout.empty_output(like)`
    lays it out (the compiled ops' fake kernels promise that layout): a view where the memory already is, else a
    copy."""
    b, h, n, d = like.shape
    rows = tokens.contiguous().view(b, n, h, d).transpose(1, 2)
    if heads_inside(like):
        return rows.as_strided(rows.shape, (n * h * d, d, h * d, 1))  # the same memory; exact strides of size-1 dims
    out = empty_output(like)
    return out.copy_(rows)


def _lse_rows(lse: Tensor, batch: int) -> Tensor:
    """The varlen kernels' (H, B * N) logsumexp as the dense kernels' (B, H, N)."""
    return lse.view(lse.shape[0], batch, -1).transpose(0, 1).contiguous()


def _lse_tokens(lse: Tensor) -> Tensor:
    """The dense (B, H, N) logsumexp as the varlen kernels' (H, B * N)."""
    return lse.transpose(0, 1).reshape(lse.shape[1], -1)


def _varlen_forward(tq: Tensor, tk: Tensor, tv: Tensor, found: Sequences, window: Window, scale: float,
                    triton: bool) -> tuple[Tensor, Tensor]:
    cu, lengths = found.cu_seqlens, (found.longest, found.longest)
    if not triton:
        return flash_varlen_forward_torch(tq, tk, tv, cu, cu, *window, scale)
    from . import calls, launcher

    with calls.on_device(tq):
        o, lse = launcher.varlen_forward(*calls.interpreter_upcast(tq, tk, tv), launcher.Offsets(cu, cu), lengths,
                                         window, scale)
    return calls.same_dtype((o,), (tq,))[0], lse


def _varlen_backward(tokens: list[Tensor], lse: Tensor, found: Sequences, window: Window, scale: float,
                     triton: bool) -> tuple[Tensor, ...]:
    cu, lengths = found.cu_seqlens, (found.longest, found.longest)
    if not triton:
        return flash_varlen_backward_torch(*tokens[:4], lse, tokens[4], cu, cu, *window, scale)
    from . import calls, launcher

    with calls.on_device(tokens[0]):
        grads = launcher.varlen_backward(*calls.interpreter_upcast(*tokens[:4]), lse,
                                         calls.interpreter_upcast(tokens[4])[0], launcher.Offsets(cu, cu), lengths,
                                         window, scale)
    return calls.same_dtype(grads, tokens[:3])


def _scatter(values: Tensor, index: Tensor | None, dim: int, total: int, fill: float) -> Tensor:
    """`values` of the real tokens placed at `index` along `dim` of a `total`-long tensor filled with `fill` (padded
    rows), or `values` itself (every token real)."""
    if index is None:
        return values
    shape = list(values.shape)
    shape[dim] = total
    return values.new_full(shape, fill).index_copy_(dim, index.long(), values)


def forward(q: Tensor, k: Tensor, v: Tensor, plan: Tensor, window_left: int, window_right: int,
            softmax_scale: float, triton: bool) -> tuple[Tensor, Tensor]:
    """(O laid out as `empty_output(q)`, L (B, Hq, N)) for rank-4 q, k, v whose rows' sequences `plan` holds;
    `triton` picks the Triton kernels over the tiled PyTorch ones."""
    window, (batch, n) = (window_left, window_right), (q.shape[0], q.shape[2])
    found = plan_sequences(plan)
    if found is None:
        if triton:
            from . import library_ops

            return library_ops.opaque_forward(q, k, v, window_left, window_right, softmax_scale)
        o, lse = flash_forward_torch(q, k, v, *window, softmax_scale)
        return laid_out(o, q), lse
    tokens = [_flat_tokens(t) for t in (q, k, v)]
    if found.tokens is not None:
        tokens = [t.index_select(0, found.tokens) for t in tokens]
    o, lse = _varlen_forward(*tokens, found, window, softmax_scale, triton)
    o = _scatter(o, found.tokens, 0, batch * n, 0.0)
    lse = _scatter(lse, found.tokens, 1, batch * n, float("-inf"))
    return _as_rows(o, q), _lse_rows(lse, batch)


def backward(q: Tensor, k: Tensor, v: Tensor, o: Tensor, lse: Tensor, do: Tensor, plan: Tensor,
             window_left: int, window_right: int, softmax_scale: float, triton: bool
             ) -> tuple[Tensor, Tensor, Tensor]:
    """(dQ, dK, dV), each laid out as `empty_output` lays out its input, from `forward`'s O and L; dO may have
    any strides."""
    window, (batch, n) = (window_left, window_right), (q.shape[0], q.shape[2])
    found = plan_sequences(plan)
    if found is None:
        if triton:
            from . import library_ops

            return library_ops.opaque_backward(q, k, v, o, lse, do, window_left, window_right, softmax_scale)
        grads = flash_backward_torch(q, k, v, o, lse, do, *window, softmax_scale)
        return tuple(laid_out(g, x) for g, x in zip(grads, (q, k, v)))
    tokens, lse = [_flat_tokens(t) for t in (q, k, v, o, do)], _lse_tokens(lse)
    if found.tokens is not None:
        tokens, lse = [t.index_select(0, found.tokens) for t in tokens], lse.index_select(1, found.tokens)
    grads = _varlen_backward(tokens, lse, found, window, softmax_scale, triton)
    return tuple(_as_rows(_scatter(g, found.tokens, 0, batch * n, 0.0), x) for g, x in zip(grads, (q, k, v)))


def _find_documents_fake(position_ids, batch):
    return position_ids.new_empty(plan_size(batch, position_ids.shape[1]), dtype=torch.int32)


def _find_offsets_fake(cu_seqlens_q, cu_seqlens_k, batch, n):
    return cu_seqlens_q.new_empty(plan_size(batch, n), dtype=torch.int32)


def _find_padding_fake(mask):
    return mask.new_empty(plan_size(*mask.shape), dtype=torch.int32)


def _forward_fake(q, k, v, plan, window_left, window_right, softmax_scale, triton):
    lse_dtype = torch.float64 if q.dtype == torch.float64 else torch.float32
    return empty_output(q), q.new_empty(q.shape[:-1], dtype=lse_dtype)


def _backward_fake(q, k, v, o, lse, do, plan, window_left, window_right, softmax_scale, triton):
    return empty_output(q), empty_output(k), empty_output(v)


# Opaque ops (`op_library.define_op`), as `library_ops`' are: no Python autograd kernel in the call path (the ops are
# called inside `PackedRows`' forward and backward and never differentiated themselves).
_TAGS = (torch.Tag.cudagraph_unsafe,) if hasattr(torch.Tag, "cudagraph_unsafe") else ()
_FINDERS = {  # the ops that make a plan, by name (`find_plan`)
    "find_documents": define_op("find_documents", "(Tensor position_ids, int batch) -> Tensor", document_plan,
                                _find_documents_fake, _TAGS),
    "find_padding": define_op("find_padding", "(Tensor mask) -> Tensor", padding_plan, _find_padding_fake, _TAGS),
    "find_offsets": define_op("find_offsets", "(Tensor cu_seqlens_q, Tensor cu_seqlens_k, int batch, int n) -> Tensor",
                              offsets_plan, _find_offsets_fake, _TAGS),
}
_FORWARD_OP = define_op("packed_rows_forward", "(Tensor q, Tensor k, Tensor v, Tensor plan, int window_left, "
                        "int window_right, float softmax_scale, bool triton) -> (Tensor, Tensor)", forward,
                        _forward_fake, _TAGS)
_BACKWARD_OP = define_op("packed_rows_backward", "(Tensor q, Tensor k, Tensor v, Tensor o, Tensor lse, Tensor do, "
                         "Tensor plan, int window_left, int window_right, float softmax_scale, bool triton) "
                         "-> (Tensor, Tensor, Tensor)", backward, _backward_fake, _TAGS)


class PackedRows(torch.autograd.Function):
    """`flash_attention_packed` and `flash_attention_padded` over a plan's sequences: the op pair above. `PackedRows.apply(q, k, v, plan, window, softmax_scale, triton)` with checked
    arguments (the window as (left, right) bounds)."""

    @staticmethod
    def forward(ctx, q: Tensor, k: Tensor, v: Tensor, plan: Tensor, window: Window, softmax_scale: float,
                triton: bool) -> Tensor:
        o, lse = _FORWARD_OP(q, k, v, plan, *window, softmax_scale, triton)
        ctx.save_for_backward(q, k, v, o, lse, plan)
        ctx.window, ctx.scale, ctx.triton = window, softmax_scale, triton
        return o

    @staticmethod
    def backward(ctx, do: Tensor):
        refuse_double_backward("flash_attention_packed / flash_attention_padded")
        q, k, v, o, lse, plan = ctx.saved_tensors
        dq, dk, dv = _BACKWARD_OP(q, k, v, o, lse, do, plan, *ctx.window, ctx.scale, ctx.triton)
        return dq, dk, dv, None, None, None, None
