"""Input checks shared by every attention op, so bad input fails with a clear message.

Without these, a mismatched shape becomes a silent broadcast, a Triton compile error or an illegal
memory access. Every message names the argument and the offending shape, dtype or device.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import numpy as np
import torch

from .readback import read_once

FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
MAX_HEAD_DIM = 256  # the Triton op's largest head dim (its biggest tile table)
MAX_DECODE_QUERIES = 16  # query rows per sequence the decode kernels take
MAX_DECODE_GROUP_ROWS = 64  # query heads per K/V head times Nq: one decode program's rows


def decode_fits(n_q: int, kv_group: int) -> bool:
    """Whether the decode kernels take Nq queries per sequence with `kv_group` query heads per K/V head: 1 to
    MAX_DECODE_QUERIES queries (none is the dense kernels' empty grid), the group's rows (kv_group * Nq) in one
    program."""
    return 0 < n_q <= MAX_DECODE_QUERIES and kv_group * n_q <= MAX_DECODE_GROUP_ROWS


def check_attention_inputs(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    is_causal: bool,
    softmax_scale: float | None,
    *,
    op: str,
    allowed_dtypes: tuple[torch.dtype, ...] = FLOAT_DTYPES,
    max_head_dim: int | None = None,
) -> float:
    """Validate q, k, v and the flags; return the softmax scale to use."""
    _check_tensors(q, k, v, op, allowed_dtypes, ranks=(3, 4),
                   layout="(batch, seq, head_dim) or (batch, heads, seq, head_dim)")
    problem = _shape_problem(q, k, v, max_head_dim)
    if problem is not None:
        raise ValueError(f"{op}: {problem} (q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)})")
    return _checked_scale(q, is_causal, softmax_scale, op)


def _check_tensors(q, k, v, op: str, allowed_dtypes, ranks: tuple[int, ...], layout: str) -> None:
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{op}: {name} must be a torch.Tensor, got {type(t).__name__}")
        if t.dtype not in allowed_dtypes:
            names = ", ".join(str(d).replace("torch.", "") for d in allowed_dtypes)
            raise TypeError(f"{op}: {name} has dtype {t.dtype}; supported dtypes are {names}")
        if t.dim() not in ranks:
            raise ValueError(f"{op}: {name} must have shape {layout}, got rank {t.dim()} with shape {tuple(t.shape)}")
    if not (q.dtype == k.dtype == v.dtype):
        raise TypeError(f"{op}: q, k, v must share one dtype, got q {q.dtype}, k {k.dtype}, v {v.dtype}")
    if not (q.device == k.device == v.device):
        raise ValueError(f"{op}: q, k, v must be on one device, got q {q.device}, k {k.device}, v {v.device}")


def check_varlen_inputs(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens_q: torch.Tensor, cu_seqlens_k: torch.Tensor,
    max_seqlen_q: int, max_seqlen_k: int, is_causal: bool, softmax_scale: float | None, *, op: str,
    allowed_dtypes: tuple[torch.dtype, ...] = FLOAT_DTYPES, max_head_dim: int | None = None,
) -> float:
    """Validate packed q (total_q, Hq, D), k, v (total_k, Hkv, D) and flash-attn's cu_seqlens; return the scale.

    The offsets are read back to check them. On a CPU that is cheap and done on every call. On a GPU it waits for
    the device, so it is done once per offsets tensor: a model passes the same one to every layer, and later calls
    with it (unmodified: the same storage and version counter) reuse the result."""
    _check_tensors(q, k, v, op, allowed_dtypes, ranks=(3,), layout="(total_tokens, heads, head_dim)")
    if k.shape != v.shape or q.shape[-1] != k.shape[-1]:
        raise ValueError(f"{op}: k and v must have one shape and q, k one head_dim (q {tuple(q.shape)}, k "
                         f"{tuple(k.shape)}, v {tuple(v.shape)})")
    if q.shape[-1] == 0:
        raise ValueError(f"{op}: head_dim must be positive, got q {tuple(q.shape)}")
    if (k.shape[1] == 0 and q.shape[1] != 0) or (k.shape[1] and q.shape[1] % k.shape[1]):
        raise ValueError(f"{op}: the query heads ({q.shape[1]}) must be a multiple of the key/value heads "
                         f"({k.shape[1]})")
    if max_head_dim is not None and q.shape[-1] > max_head_dim:
        raise ValueError(f"{op}: head_dim {q.shape[-1]} is above the supported maximum {max_head_dim}")
    lengths = {}
    for name, cu, total, longest in (("cu_seqlens_q", cu_seqlens_q, q.shape[0], max_seqlen_q),
                                     ("cu_seqlens_k", cu_seqlens_k, k.shape[0], max_seqlen_k)):
        check_offsets(cu, total, longest, q.device, name=name, op=op)
        lengths[name] = cu.numel()
    if lengths["cu_seqlens_q"] != lengths["cu_seqlens_k"]:
        raise ValueError(f"{op}: cu_seqlens_q and cu_seqlens_k must describe the same number of sequences, got "
                         f"{lengths['cu_seqlens_q'] - 1} and {lengths['cu_seqlens_k'] - 1}")
    return _checked_scale(q, is_causal, softmax_scale, op)


def check_offsets(cu, total: int, max_seqlen, device: torch.device, *, name: str, op: str) -> None:
    """Check flash-attn's offsets `cu` over `total` packed tokens: an int32 (batch + 1,) tensor on `device`,
    starting at 0, never decreasing, ending at `total`, its longest sequence at most the int `max_seqlen`.

    Raises:
        ValueError: naming `name` and showing what is wrong.
    """
    if not isinstance(cu, torch.Tensor) or cu.dtype != torch.int32 or cu.dim() != 1 or cu.numel() < 2:
        what = f"{cu.dtype} of shape {tuple(cu.shape)}" if isinstance(cu, torch.Tensor) else type(cu).__name__
        raise ValueError(f"{op}: {name} must be an int32 tensor of shape (batch + 1,), got {what}")
    if cu.device != device:
        raise ValueError(f"{op}: {name} is on {cu.device}, the tokens on {device}")
    last, longest_found = _offsets_summary(cu, name, op)
    if last != total:
        raise ValueError(f"{op}: {name} must end at the token count {total}, got {last}")
    if isinstance(max_seqlen, bool) or not isinstance(max_seqlen, int) or max_seqlen < longest_found:
        raise ValueError(f"{op}: max_seqlen for {name} must be an int >= the longest sequence "
                         f"({longest_found}), got {max_seqlen!r}")


def _read_once(t: torch.Tensor, kind: str, check: Callable[[list[int]], object]) -> object:
    """check(t.tolist()) (which may raise on a bad tensor), once per unchanged GPU tensor and `kind` of check. What
    `check` returns must not depend on anything but the values: the caller compares it with the call's sizes."""
    return read_once(t, kind, lambda values: check(values.tolist()))


def _offsets_summary(cu: torch.Tensor, name: str, op: str) -> tuple[int, int]:
    """(last offset, longest sequence) of a well-formed offsets tensor: starting at 0, never decreasing.

    Raises:
        ValueError: otherwise, showing the offsets.
    """

    def check(offsets: list[int]) -> tuple[int, int]:
        steps = [b - a for a, b in zip(offsets, offsets[1:])]
        if offsets[0] != 0 or min(steps) < 0:
            raise ValueError(f"{op}: {name} must start at 0, never decrease and end at the token count, "
                             f"got {_shown(offsets)}")
        return offsets[-1], max(steps)

    return _read_once(cu, "offsets", check)


def _shown(values: list[int]) -> list:
    return values if len(values) <= 12 else values[:6] + ["..."] + values[-3:]


def _integer(t) -> bool:
    """Whether `t` is a tensor of an integer dtype (bool is not one)."""
    return (isinstance(t, torch.Tensor) and not t.dtype.is_floating_point and not t.dtype.is_complex
            and t.dtype != torch.bool)


def check_position_ids(position_ids, batch: int, n: int, device: torch.device, *, op: str) -> None:
    """Check position ids for `batch` rows of `n` tokens: an integer (batch, n) or (1, n) tensor on `device`.

    Raises:
        ValueError: naming position_ids and what is wrong.
    """
    if not _integer(position_ids):
        what = position_ids.dtype if isinstance(position_ids, torch.Tensor) else type(position_ids).__name__
        raise ValueError(f"{op}: position_ids must be an integer tensor, got {what}")
    if position_ids.dim() != 2 or position_ids.shape[0] not in (1, batch) or position_ids.shape[1] != n:
        raise ValueError(f"{op}: position_ids must be ({batch}, {n}) or (1, {n}) for {batch} rows of {n} tokens, got "
                         f"{tuple(position_ids.shape)}")
    if position_ids.device != device:
        raise ValueError(f"{op}: position_ids is on {position_ids.device}, q on {device}")


def check_index_vector(t, device: torch.device, *, name: str, op: str) -> None:
    """Check that `t` is a 1-D integer tensor on `device` (offsets, starts); its values are checked when read.

    Raises:
        ValueError: naming `name` and what is wrong.
    """
    if not _integer(t) or t.dim() != 1:
        what = f"{t.dtype} of shape {tuple(t.shape)}" if isinstance(t, torch.Tensor) else type(t).__name__
        raise ValueError(f"{op}: {name} must be a 1-D integer tensor, got {what}")
    if t.device != device:
        raise ValueError(f"{op}: {name} is on {t.device}, q on {device}")


def check_padding_mask(mask, batch: int, n: int, device: torch.device, *, op: str) -> None:
    """Check a padding mask for `batch` rows of `n` tokens: a bool or integer (batch, n) tensor on `device`.

    Raises:
        ValueError: naming padding_mask and what is wrong.
    """
    if not (_integer(mask) or isinstance(mask, torch.Tensor) and mask.dtype == torch.bool):
        what = mask.dtype if isinstance(mask, torch.Tensor) else type(mask).__name__
        raise ValueError(f"{op}: padding_mask must be a bool or integer tensor (nonzero: a real token), got {what}")
    if tuple(mask.shape) != (batch, n):
        raise ValueError(f"{op}: padding_mask must be ({batch}, {n}) for {batch} rows of {n} tokens, got "
                         f"{tuple(mask.shape)}")
    if mask.device != device:
        raise ValueError(f"{op}: padding_mask is on {mask.device}, q on {device}")


def check_cache_start(cache_start, batch: int, n_keys: int, device: torch.device, *, op: str) -> torch.Tensor:
    """Check a decode call's per-row first keys: an integer (batch,) tensor on `device`, each in [0, n_keys] (n_keys:
    the row sees no key). Returns it as the kernels read it (int32, contiguous). Read back once per unchanged GPU
    tensor, as the offsets are.

    Raises:
        ValueError: naming cache_start and showing what is wrong.
    """
    _check_row_tensor(cache_start, "cache_start", (torch.int32, torch.int64), (batch,),
                      f"an int32 or int64 tensor of shape (batch,) = ({batch},)", device, op)
    lowest, highest, shown = _read_once(cache_start, "cache_start",
                                        lambda s: (min(s, default=0), max(s, default=0), _shown(s)))
    if lowest < 0 or highest > n_keys:
        raise ValueError(f"{op}: cache_start must lie in [0, {n_keys}] (the keys), got {shown}")
    return cache_start.to(torch.int32).contiguous()


def _check_row_tensor(t, name: str, dtypes: tuple, shape: tuple, wanted: str, device: torch.device,
                      op: str) -> None:
    """The checks a decode call's per-row tensors share: a tensor of one of `dtypes`, of `shape`, on `device`."""
    if not isinstance(t, torch.Tensor) or t.dtype not in dtypes or t.shape != shape:
        what = f"{t.dtype} of shape {tuple(t.shape)}" if isinstance(t, torch.Tensor) else type(t).__name__
        raise ValueError(f"{op}: {name} must be {wanted}, got {what}")
    if t.device != device:
        raise ValueError(f"{op}: {name} is on {t.device}, the queries on {device}")


def check_key_mask(key_mask, batch: int, n_keys: int, device: torch.device, *, op: str) -> None:
    """Check a decode call's key mask: a bool (batch, n_keys) tensor on `device` whose keys are adjacent in memory
    (the kernels read each row as bytes). Its values are not read.

    Raises:
        ValueError: naming key_mask and showing what is wrong.
    """
    _check_row_tensor(key_mask, "key_mask", (torch.bool,), (batch, n_keys),
                      f"a bool tensor of shape (batch, Nk) = ({batch}, {n_keys})", device, op)
    if n_keys > 1 and key_mask.stride(1) != 1:
        raise ValueError(f"{op}: key_mask's keys must be adjacent in memory (stride 1 along Nk), got strides "
                         f"{tuple(key_mask.stride())}; pass key_mask.contiguous()")


def _checked_scale(q: torch.Tensor, is_causal, softmax_scale, op: str) -> float:
    if not isinstance(is_causal, (bool, np.bool_)):  # 2 or 0.5 would be "truthy" and silently mean causal
        raise TypeError(f"{op}: is_causal must be True or False, got {type(is_causal).__name__} {is_causal!r}")
    if softmax_scale is None:
        return 1.0 / math.sqrt(q.shape[-1])
    if isinstance(softmax_scale, (bool, np.bool_, torch.Tensor)) or not isinstance(softmax_scale, (int, float)):
        raise TypeError(f"{op}: softmax_scale must be a Python float or None, got {type(softmax_scale).__name__} "
                        f"{softmax_scale!r}")
    if not math.isfinite(softmax_scale) or softmax_scale <= 0:
        raise ValueError(f"{op}: softmax_scale must be a positive finite number, got {softmax_scale}")
    return float(softmax_scale)


_INT64_MAX = (1 << 63) - 1


def normalize_window(window_size, causal: bool, op: str, n_queries: int | None = None,
                     n_keys: int | None = None) -> tuple[int, int]:
    """(left, right) key bounds from flash-attn's `window_size` and `causal`, -1 meaning unbounded; causal sets
    right to 0. (-1, -1) is plain attention, (-1, 0) causal attention.

    Given the query and key counts (of the longest sequence, or any upper bound), a bound at least that wide
    bounds nothing and becomes -1: the kernels add the bounds to 32-bit row indices, and `(-1, 2**31 - 1)` must
    not wrap around into a mask that hides every key.

    Raises:
        TypeError, ValueError: for anything but None or a pair of 64-bit ints, each -1 or >= 0.
    """
    if window_size is None:
        left, right = -1, -1
    else:
        if (not isinstance(window_size, (tuple, list)) or len(window_size) != 2
                or not all(isinstance(w, int) and not isinstance(w, bool) for w in window_size)):
            raise TypeError(f"{op}: window_size must be a pair of ints (left, right), got {window_size!r}")
        left, right = window_size
        if left < -1 or right < -1:
            raise ValueError(f"{op}: window_size entries must be -1 (unbounded) or >= 0, got {tuple(window_size)}")
        if left > _INT64_MAX or right > _INT64_MAX:  # no kernel argument or plan key holds it
            raise ValueError(f"{op}: window_size entries must fit in 64 bits (use -1 for unbounded), got "
                             f"{tuple(window_size)}")
    right = 0 if causal else right
    if n_keys is not None and left >= n_keys:
        left = -1
    if n_queries is not None and right >= n_queries:
        right = -1
    return left, right


def refuse_double_backward(op: str) -> None:
    """Raise when a backward runs with create_graph=True (grad mode on inside backward).

    The flash backward recomputes attention from the saved logsumexp; differentiating that recomputation
    again gives wrong second-order gradients, so it is refused with a message instead of silently."""
    if torch.is_grad_enabled():
        raise RuntimeError(
            f"{op}: double backward is not supported (backward ran with create_graph=True, as in gradgradcheck or "
            "a gradient penalty). Use the 'naive' attention backend (flashsys.ops.attention_reference) for "
            "higher-order gradients."
        )


def _shape_problem(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, max_head_dim: int | None) -> str | None:
    """What is wrong with the shapes, or None. Separate, so the message is only formatted on error:
    this check runs on every call, and formatting it eagerly cost about as much as a kernel launch."""
    if not (q.dim() == k.dim() == v.dim()):
        return "q, k, v must have the same rank"
    if not (q.shape[0] == k.shape[0] == v.shape[0]):
        return "q, k, v must have the same batch size (dim 0)"
    if q.dim() == 4:
        if k.shape[1] != v.shape[1]:
            return f"k and v must have the same number of heads, got {k.shape[1]} and {v.shape[1]}"
        if (k.shape[1] == 0 and q.shape[1] != 0) or (k.shape[1] and q.shape[1] % k.shape[1]):
            return (f"the query heads ({q.shape[1]}) must be a multiple of the key/value heads ({k.shape[1]}) for "
                    "grouped-query attention")
    if not (q.shape[-1] == k.shape[-1] == v.shape[-1]):
        return "q, k, v must have the same head_dim (last dim)"
    if k.shape[-2] != v.shape[-2]:
        return "k and v must have the same sequence length"
    if q.shape[-1] == 0:
        return "head_dim must be positive"
    if max_head_dim is not None and q.shape[-1] > max_head_dim:
        return f"head_dim {q.shape[-1]} is above the supported maximum {max_head_dim}"
    return None
