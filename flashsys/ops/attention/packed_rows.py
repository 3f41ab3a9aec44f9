"""Rows that may pack several documents, told apart by their position ids: a document starts wherever a row's
positions do not go on by one (how transformers recognises packed sequences). `flash_attention_packed` is the entry
point; this module finds the documents and holds the op pair a compiled graph calls.

Whether a batch is packed is known only by reading its positions back from the device. An eager call reads them
(once per positions tensor, `readback`) and takes the dense kernels for whole rows or the varlen kernels for packed
ones. A traced call cannot branch on a tensor's values: Dynamo would break the graph around the reading, in every
layer. It calls opaque ops instead, which read and choose when the graph runs:

- `flashsys::find_documents(position_ids, batch)` reads the positions (a wait for the device) and returns a *plan*:
  an int32 tensor holding the documents' count, the longest one's length and their offsets. Every layer calls it
  with the same positions, so AOTAutograd's common-subexpression pass leaves one call per graph: one reading a step,
  forward and backward together, however many layers share the positions.
- `flashsys::packed_rows_forward` / `_backward` take the plan and run the dense or the varlen kernels. They learn
  the plan's count and longest document without reading it back: `find_documents` notes them by the plan's address
  (only that op makes plans, and it notes every one it makes, so an address's note is its live plan's).

Whole and packed rows give O, the logsumexp and the gradients one layout, so the graph does not depend on the choice.
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
from .layout import empty_output, heads_inside
from .readback import read_once
from .validation import refuse_double_backward

Window = tuple[int, int]


class Documents(NamedTuple):
    """The documents of a batch of rows, as the varlen kernels take them: int32 offsets of each document's first
    token in the flattened (batch * N) tokens, ending at batch * N, and the longest document's length."""

    cu_seqlens: Tensor
    longest: int


def documents(position_ids: Tensor, batch: int) -> Documents | None:
    """The documents of `batch` rows with these (1 or batch, N) position ids, or None where every row is one
    document. Read back once per unchanged positions tensor (a model hands every layer the same one)."""
    return read_once(position_ids, f"documents of {batch} rows", lambda p: _find_documents(p.expand(batch, -1)))


def _find_documents(positions: Tensor) -> Documents | None:
    batch, n = positions.shape
    starts = torch.ones_like(positions, dtype=torch.bool)
    starts[:, 1:] = positions[:, 1:] - positions[:, :-1] != 1
    if not bool(starts[:, 1:].any()):
        return None
    flat_starts = starts.reshape(-1).nonzero().view(-1).to(torch.int32)
    end = torch.tensor([batch * n], dtype=torch.int32, device=positions.device)
    cu = torch.cat([flat_starts, end])
    return Documents(cu, int((cu[1:] - cu[:-1]).max()))


PLAN_HEADER = 2  # a plan's count of documents (0: whole rows) and longest document, before its offsets
# (device, address) of each plan `find_documents` made -> (count, longest). Bounded: a plan whose note was dropped is
# read back instead.
_plan_notes: dict[tuple[torch.device, int], tuple[int, int]] = {}


def find_documents(position_ids: Tensor, batch: int) -> Tensor:
    """`flashsys::find_documents`' body: the plan of `batch` rows with these (1 or batch, N) positions, an int32
    (PLAN_HEADER + batch * N + 1,) tensor: [count, longest, offsets...], count 0 for whole rows."""
    found = _find_documents(position_ids.expand(batch, -1))
    plan = torch.empty(PLAN_HEADER + batch * position_ids.shape[1] + 1, dtype=torch.int32,
                       device=position_ids.device)
    count, longest = (0, 0) if found is None else (found.cu_seqlens.numel() - 1, found.longest)
    plan[0], plan[1] = count, longest
    if found is not None:
        plan[PLAN_HEADER:PLAN_HEADER + count + 1].copy_(found.cu_seqlens)
    if len(_plan_notes) > 256:
        _plan_notes.clear()
    _plan_notes[(plan.device, plan.data_ptr())] = (count, longest)
    return plan


def plan_documents(plan: Tensor) -> Documents | None:
    """The documents a `find_documents` plan holds (None: whole rows), from its note, or read back where the note
    was dropped."""
    count, longest = _plan_notes.get((plan.device, plan.data_ptr())) or plan[:PLAN_HEADER].tolist()
    return None if count == 0 else Documents(plan[PLAN_HEADER:PLAN_HEADER + count + 1], longest)


def flat_tokens(t: Tensor) -> Tensor:
    """(B, H, N, D) as the varlen kernels' (B * N, H, D) tokens: a view where `t` keeps its heads inside its
    sequence dimension (a model's projections), else a copy."""
    return t.transpose(1, 2).reshape(-1, t.shape[1], t.shape[3])


def as_rows(tokens: Tensor, like: Tensor) -> Tensor:
    """(B * N, H, D) tokens as the (B, H, N, D) tensor shaped like `like`, laid out as `layout.empty_output(like)`
    lays it out (the compiled ops' fake kernels promise that layout): a view where the memory already is, else a
    copy."""
    b, h, n, d = like.shape
    rows = tokens.contiguous().view(b, n, h, d).transpose(1, 2)
    if heads_inside(like):
        return rows.as_strided(rows.shape, (n * h * d, d, h * d, 1))  # the same memory; exact strides of size-1 dims
    out = empty_output(like)
    return out.copy_(rows)


def _laid_out(t: Tensor, like: Tensor) -> Tensor:
    """A dense (B, H, N, D) result in `empty_output(like)`'s layout."""
    if heads_inside(like):
        out = empty_output(like)
        return out.copy_(t)
    return t.contiguous()


def _lse_rows(lse: Tensor, batch: int) -> Tensor:
    """The varlen kernels' (H, B * N) logsumexp as the dense kernels' (B, H, N)."""
    return lse.view(lse.shape[0], batch, -1).transpose(0, 1).contiguous()


def _lse_tokens(lse: Tensor) -> Tensor:
    """The dense (B, H, N) logsumexp as the varlen kernels' (H, B * N)."""
    return lse.transpose(0, 1).reshape(lse.shape[1], -1)


def forward(q: Tensor, k: Tensor, v: Tensor, plan: Tensor, window_left: int, window_right: int,
            softmax_scale: float, triton: bool) -> tuple[Tensor, Tensor]:
    """(O laid out as `empty_output(q)`, L (B, Hq, N)) for rank-4 q, k, v whose rows' documents `plan` holds;
    `triton` picks the Triton kernels over the tiled PyTorch ones."""
    window, batch = (window_left, window_right), q.shape[0]
    found = plan_documents(plan)
    if found is None:
        if triton:
            from . import library_ops

            return library_ops.opaque_forward(q, k, v, window_left, window_right, softmax_scale)
        o, lse = flash_forward_torch(q, k, v, *window, softmax_scale)
        return _laid_out(o, q), lse
    tq, tk, tv = (flat_tokens(t) for t in (q, k, v))
    if triton:
        from . import calls, launcher

        with calls.on_device(q):
            o, lse = launcher.varlen_forward(*calls.interpreter_upcast(tq, tk, tv),
                                             launcher.Offsets(found.cu_seqlens, found.cu_seqlens),
                                             (found.longest, found.longest), window, softmax_scale)
        o = calls.same_dtype((o,), (q,))[0]
    else:
        o, lse = flash_varlen_forward_torch(tq, tk, tv, found.cu_seqlens, found.cu_seqlens, *window, softmax_scale)
    return as_rows(o, q), _lse_rows(lse, batch)


def backward(q: Tensor, k: Tensor, v: Tensor, o: Tensor, lse: Tensor, do: Tensor, plan: Tensor,
             window_left: int, window_right: int, softmax_scale: float, triton: bool
             ) -> tuple[Tensor, Tensor, Tensor]:
    """(dQ, dK, dV), each laid out as `empty_output` lays out its input, from `forward`'s O and L; dO may have
    any strides."""
    window = (window_left, window_right)
    found = plan_documents(plan)
    if found is None:
        if triton:
            from . import library_ops

            return library_ops.opaque_backward(q, k, v, o, lse, do, window_left, window_right, softmax_scale)
        grads = flash_backward_torch(q, k, v, o, lse, do, *window, softmax_scale)
        return tuple(_laid_out(g, x) for g, x in zip(grads, (q, k, v)))
    tokens = [flat_tokens(t) for t in (q, k, v, o, do)]
    lse, cu = _lse_tokens(lse), found.cu_seqlens
    if triton:
        from . import calls, launcher

        with calls.on_device(q):
            grads = launcher.varlen_backward(*calls.interpreter_upcast(*tokens[:4]), lse,
                                             calls.interpreter_upcast(tokens[4])[0], launcher.Offsets(cu, cu),
                                             (found.longest, found.longest), window, softmax_scale)
        grads = calls.same_dtype(grads, (q, k, v))
    else:
        grads = flash_varlen_backward_torch(*tokens[:4], lse, tokens[4], cu, cu, *window, softmax_scale)
    return tuple(as_rows(g, x) for g, x in zip(grads, (q, k, v)))


# Defined on a torch.library.Library, as `library_ops`' opaque ops are (no Python autograd kernel in the call path:
# the ops are called inside `PackedRows`' forward and backward and never differentiated themselves).
_OPS = torch.library.Library("flashsys", "FRAGMENT")
_TAGS = (torch.Tag.cudagraph_unsafe,) if hasattr(torch.Tag, "cudagraph_unsafe") else ()
_OPS.define("find_documents(Tensor position_ids, int batch) -> Tensor", tags=_TAGS)
_OPS.define("packed_rows_forward(Tensor q, Tensor k, Tensor v, Tensor plan, int window_left, "
            "int window_right, float softmax_scale, bool triton) -> (Tensor, Tensor)", tags=_TAGS)
_OPS.define("packed_rows_backward(Tensor q, Tensor k, Tensor v, Tensor o, Tensor lse, Tensor do, "
            "Tensor plan, int window_left, int window_right, float softmax_scale, bool triton) "
            "-> (Tensor, Tensor, Tensor)", tags=_TAGS)
_OPS.impl("find_documents", find_documents, "CompositeExplicitAutograd")
_OPS.impl("packed_rows_forward", forward, "CompositeExplicitAutograd")
_OPS.impl("packed_rows_backward", backward, "CompositeExplicitAutograd")


@torch.library.register_fake("flashsys::find_documents", lib=_OPS)
def _find_documents_fake(position_ids, batch):
    return position_ids.new_empty(PLAN_HEADER + batch * position_ids.shape[1] + 1, dtype=torch.int32)


@torch.library.register_fake("flashsys::packed_rows_forward", lib=_OPS)
def _forward_fake(q, k, v, plan, window_left, window_right, softmax_scale, triton):
    lse_dtype = torch.float64 if q.dtype == torch.float64 else torch.float32
    return empty_output(q), q.new_empty(q.shape[:-1], dtype=lse_dtype)


@torch.library.register_fake("flashsys::packed_rows_backward", lib=_OPS)
def _backward_fake(q, k, v, o, lse, do, plan, window_left, window_right, softmax_scale, triton):
    return empty_output(q), empty_output(k), empty_output(v)


class PackedRows(torch.autograd.Function):
    """`flash_attention_packed` in a traced (torch.compile) call: the op pair above, over the documents a
    `find_documents` plan holds. `PackedRows.apply(q, k, v, plan, window, softmax_scale, triton)` with checked
    arguments (the window as (left, right) bounds)."""

    @staticmethod
    def forward(ctx, q: Tensor, k: Tensor, v: Tensor, plan: Tensor, window: Window, softmax_scale: float,
                triton: bool) -> Tensor:
        o, lse = torch.ops.flashsys.packed_rows_forward(q, k, v, plan, *window, softmax_scale, triton)
        ctx.save_for_backward(q, k, v, o, lse, plan)
        ctx.window, ctx.scale, ctx.triton = window, softmax_scale, triton
        return o

    @staticmethod
    def backward(ctx, do: Tensor):
        refuse_double_backward("flash_attention_packed")
        q, k, v, o, lse, plan = ctx.saved_tensors
        dq, dk, dv = torch.ops.flashsys.packed_rows_backward(q, k, v, o, lse, do, plan, *ctx.window,
                                                             ctx.scale, ctx.triton)
        return dq, dk, dv, None, None, None, None
