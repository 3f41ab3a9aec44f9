"""flashsys as a Hugging Face `transformers` attention implementation.

    from flashsys.integrations.transformers import register
    model = AutoModelForCausalLM.from_pretrained(name, attn_implementation=register())

`register()` adds the implementation under the name `"fsys"` (and returns it). The name cannot contain "flash":
transformers takes any such name as a request for the flash-attn package or a hub kernel and refuses it.

Every attention layer then calls `attention_forward`, which computes what the `sdpa` implementation computes:

- grouped-query and multi-query attention without copying K/V; the layer's `scaling`;
- per-layer sliding windows (`sliding_window`, None on full layers) exactly as `sdpa` masks them: a causal layer
  sees the key at its own position and the `sliding_window - 1` before it; a bidirectional one `sliding_window` on
  each side;
- 2-D padding masks (left or right padding): the real tokens run through the varlen kernels, pad tokens are never
  attended to, and their outputs are 0;
- packed rows: documents found where `position_ids` restart (as `sdpa` finds them), or the collator's
  `cu_seq_lens_q`/`cu_seq_lens_k` with `max_length_q`/`max_length_k`, through the varlen kernels;
- KV-cache decoding: the new queries are the last positions of the cache (bottom-right causal alignment); one to 16
  queries take the split-key decode kernels, a left-padded batch too (`flash_attention_decode` skips each row's
  padding in the cache instead of gathering its real keys). A static cache's slots past the keys so far are empty:
  the mask function's result ends where the keys end, and the attention function reads that many; a decoding step
  (one query) gets a key mask made on the device instead, so that torch.compile keeps it in one graph.

What flashsys does not compute is refused with an error that says what and why: attention dropout in training,
logit softcapping (Gemma 2), attention sinks (`s_aux`, GPT-OSS), position biases (T5), an arbitrary 4-D mask,
a padding mask with holes (a decoding step that takes a key mask computes any mask), a head dim above 256 or key
and value head dims that differ (MLA).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor

from ..ops.attention import (
    MAX_HEAD_DIM,
    flash_attention,
    flash_attention_decode,
    flash_attention_packed,
    flash_attention_padded,
    flash_attention_varlen,
)
from ..ops.attention.cache_decode import grad_requested
from ..ops.attention.packed_rows import real_runs
from ..ops.attention.readback import read_once
from ..ops.attention.validation import decode_fits

NAME = "fsys"

__all__ = ["NAME", "attention_forward", "padding_mask", "register"]


def register(name: str = NAME) -> str:
    """Make `attn_implementation=name` available to `from_pretrained`, `from_config` and `set_attn_implementation`
    (an attention function and its mask function). Returns the name.

    Raises:
        ImportError: where transformers is not installed (`pip install flashsys[hf]`).
        ValueError: for a name transformers would read as a flash-attn request (one containing "flash").
    """
    try:
        from transformers import AttentionInterface
        from transformers.masking_utils import AttentionMaskInterface
    except ImportError as e:
        raise ImportError(f"flashsys.integrations.transformers needs transformers ({e}); install it with "
                          "pip install 'flashsys[hf]'") from e
    if "flash" in name.lower():
        raise ValueError(f"register: transformers takes an attn_implementation containing 'flash' ({name!r}) as a "
                         "request for the flash-attn package and refuses it; choose another name")
    AttentionInterface.register(name, attention_forward)
    AttentionMaskInterface.register(name, padding_mask)
    return name


def padding_mask(batch_size: int, q_length: int | None = None, kv_length: int | None = None,
                 q_offset: int | Tensor = 0, kv_offset: int = 0, mask_function: Callable | None = None,
                 attention_mask: Tensor | None = None, cache_position: Tensor | None = None,
                 **kwargs: Any) -> Tensor | None:
    """The mask transformers hands to `attention_forward`: a 2-D (batch, keys) boolean padding mask over the keys the
    cache holds, or None when every key is real (under torch.compile, without a cache, the mask as it is: whether it
    pads anything is read when the graph runs). Causality, windows and packing are the attention function's, from
    its arguments.

    The mask's columns are the cache's first `filled` keys, filled = q_offset + q_length - kv_offset: a static cache
    holds kv_length slots, of which those past `filled` are empty, and the mask's width tells the attention function
    where its keys end (the new queries are the last q_length of them). The given mask's last column is the last
    query's position, as `generate()` keeps it and as this function returns it (transformers may hand the result
    back to it for the model's own mask).

    A decoding step (one query) over a static cache (its offset a tensor), or over a padded dynamic cache under
    torch.compile, gets a (batch, 1, 1, kv_length) key mask instead, made on the device without reading anything, so
    that a compiled decoding step is one graph; `attention_forward` hands it to `flash_attention_decode` as its key
    mask (transformers passes a 4-D mask through unchanged when it makes the model's own mask from ours). An eager
    step over a padded dynamic cache keeps the 2-D mask: where each row's keys start is read once a step, and the
    decode kernels skip the padding's tiles.

    transformers before 5.4 passes the queries' positions (`cache_position`) instead of q_length and q_offset; the
    first position is read back outside a compiled graph (inside one it stays a tensor, as a static cache's offset).

    Raises:
        ValueError: for a mask that does not cover every key the cache holds so far.
    """
    if q_length is None:
        if cache_position is None:
            raise TypeError("padding_mask: transformers passed neither q_length nor cache_position")
        q_length = cache_position.shape[0]
        q_offset = cache_position[0] if torch.compiler.is_compiling() else int(cache_position[0])
    on_device = isinstance(q_offset, Tensor) or (torch.compiler.is_compiling() and attention_mask is not None)
    if q_length == 1 and on_device and _decode_step_fits(kwargs.get("config")):
        return _decode_step_mask(batch_size, kv_length, q_offset, kv_offset, attention_mask)
    # The keys so far: all of them where the queries are all the keys (no cache before them), else read once a
    # forward (a static cache's prompt).
    filled = kv_length if q_length == kv_length else int(q_offset) + q_length - kv_offset
    if attention_mask is None:
        if filled == kv_length:
            return None
        return torch.ones(batch_size, filled, dtype=torch.bool, device=kwargs.get("device"))
    if attention_mask.shape[1] < filled:
        raise ValueError(f"flashsys attention: the attention mask has {attention_mask.shape[1]} columns, but the "
                         f"cache holds {filled} keys up to the last query; pass a mask over every position so far")
    attention_mask = attention_mask[:, -filled:].bool()
    if torch.compiler.is_compiling() and q_length == kv_length:
        return attention_mask  # whole rows or not, `flash_attention_padded` finds out when the graph runs
    if filled == kv_length and bool(attention_mask.all()):
        return None
    return attention_mask


def _decode_step_fits(config: Any) -> bool:
    """Whether one query per sequence of this model takes the decode kernels: its query heads per K/V head fit a
    decode program, and no gradient is asked for (the model is generating)."""
    heads = getattr(config, "num_attention_heads", None)
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    return (isinstance(heads, int) and isinstance(kv_heads, int) and heads % kv_heads == 0
            and decode_fits(1, heads // kv_heads) and not torch.is_grad_enabled())


def _decode_step_mask(batch_size: int, kv_length: int, q_offset: int | Tensor, kv_offset: int,
                      attention_mask: Tensor | None) -> Tensor:
    """(batch, 1, 1, kv_length) bool: which of the cache's slots the step's one query sees. Slot j holds position
    kv_offset + j; slots from the query's position + 1 on are empty (a static cache's); the given 2-D mask's last
    column is the query's position."""
    end = q_offset + 1
    device = q_offset.device if isinstance(q_offset, Tensor) else attention_mask.device
    slots = torch.arange(kv_length, device=device) + kv_offset
    keys = slots < end
    if attention_mask is None:
        keys = keys.expand(batch_size, -1)
    else:
        width = attention_mask.shape[1]
        column = slots - end + width
        real = attention_mask.bool().gather(1, column.clamp(0, width - 1).expand(batch_size, -1))
        keys = keys & (column >= 0) & real
    return keys[:, None, None, :]


def attention_forward(module: torch.nn.Module, query: Tensor, key: Tensor, value: Tensor,
                      attention_mask: Tensor | None, dropout: float = 0.0, scaling: float | None = None,
                      sliding_window: int | None = None, softcap: float | None = None, is_causal: bool | None = None,
                      **kwargs: Any) -> tuple[Tensor, None]:
    """One attention layer: query (B, Hq, Nq, D) over key, value (B, Hkv, Nk, D), the cache's keys included.
    Returns ((B, Nq, Hq, D), None), as every transformers attention function does.

    Raises:
        ValueError, TypeError: for what flashsys does not compute (see the module's docstring), naming the model
            option or argument.
    """
    _refuse_what_is_not_computed(module, query, key, value, attention_mask, dropout, softcap, kwargs)
    causal = bool(is_causal if is_causal is not None else getattr(module, "is_causal", True))
    window = _window(sliding_window, causal)
    if attention_mask is not None and attention_mask.dim() == 4:  # one query's key mask (`padding_mask`)
        out = flash_attention_decode(query, key, value, key_mask=attention_mask[:, 0, 0], causal=causal,
                                     softmax_scale=scaling, window_size=window)
        return out.transpose(1, 2).contiguous(), None
    if attention_mask is not None and query.shape[2] <= attention_mask.shape[1] < key.shape[2]:
        # A static cache: its slots past the mask's width are empty (`padding_mask`); the queries are the last keys.
        key, value = (t[:, :, :attention_mask.shape[1]] for t in (key, value))
    batch, n_q, n_k = query.shape[0], query.shape[2], key.shape[2]
    if n_q == n_k:  # no cache
        out = _split_rows(query, key, value, attention_mask, kwargs, causal=causal, softmax_scale=scaling,
                          window_size=window)
        if out is not None:
            return out.transpose(1, 2).contiguous(), None
    packed = _packed_rows(kwargs, attention_mask, batch, n_q, n_k)
    if packed is not None and packed.key_start is not None and _decodes(query, key, value):
        out = flash_attention_decode(query, key, value, cache_start=packed.key_start, causal=causal,
                                     softmax_scale=scaling, window_size=window)
        return out.transpose(1, 2).contiguous(), None
    if packed is None:
        out = flash_attention(query, key, value, causal=causal, softmax_scale=scaling, window_size=window)
        return out.transpose(1, 2).contiguous(), None
    q, k, v = (t.transpose(1, 2).reshape(-1, t.shape[1], t.shape[3]) for t in (query, key, value))
    if packed.rows_q is not None:
        q, k, v = q[packed.rows_q], k[packed.rows_k], v[packed.rows_k]
    out = flash_attention_varlen(q, k, v, packed.cu_q, packed.cu_k, packed.max_q, packed.max_k, causal=causal,
                                 softmax_scale=scaling, window_size=window)
    if packed.rows_q is not None:
        out = out.new_zeros(batch * n_q, *out.shape[1:]).index_copy_(0, packed.rows_q, out)
    return out.view(batch, n_q, *out.shape[1:]), None


def _window(sliding_window: int | None, causal: bool) -> tuple[int, int] | None:
    """flash-attn's (left, right) for transformers' sliding window: `sdpa` lets a causal query see keys
    kv > q - sliding_window, a bidirectional one |q - kv| <= sliding_window."""
    if sliding_window is None:
        return None
    if isinstance(sliding_window, bool) or not isinstance(sliding_window, int) or sliding_window < 1:
        raise ValueError(f"flashsys attention: sliding_window must be a positive int or None, got {sliding_window!r}")
    return (sliding_window - 1, 0) if causal else (sliding_window, sliding_window)


def _refuse_what_is_not_computed(module, query, key, value, attention_mask, dropout, softcap, kwargs) -> None:
    config = getattr(module, "config", None)
    model = type(config).__name__.removesuffix("Config") if config is not None else type(module).__name__
    if dropout:
        raise ValueError(f"flashsys attention ({model}): attention dropout {dropout} (the config's attention_dropout, "
                         "applied in train mode) is not implemented; set attention_dropout=0.0, or train with "
                         "attn_implementation='sdpa'")
    if softcap is not None:
        raise ValueError(f"flashsys attention ({model}): logit softcapping (attn_logit_softcapping={softcap}) is not "
                         "implemented; use attn_implementation='eager' or 'flex_attention' for this model")
    if kwargs.get("s_aux") is not None or kwargs.get("sinks") is not None:
        raise ValueError(f"flashsys attention ({model}): attention sinks (s_aux) are not implemented; use "
                         "attn_implementation='eager' or 'flex_attention' for this model")
    if kwargs.get("position_bias") is not None:
        raise ValueError(f"flashsys attention ({model}): additive position biases (position_bias) are not "
                         "implemented; use attn_implementation='sdpa' or 'eager' for this model")
    if attention_mask is not None and not _key_mask_of_one_query(attention_mask, query, key) and (
            not isinstance(attention_mask, Tensor) or attention_mask.dim() != 2):
        what = f"a {attention_mask.dim()}-D {attention_mask.dtype} tensor" if isinstance(attention_mask, Tensor) \
            else type(attention_mask).__name__
        raise ValueError(f"flashsys attention ({model}): the attention mask is {what}; flashsys takes None or a 2-D "
                         "padding mask (batch, keys) and computes causality, windows and packing itself. An arbitrary "
                         "mask needs attn_implementation='sdpa'")
    head_dim, v_head_dim = query.shape[-1], value.shape[-1]
    if v_head_dim != head_dim or key.shape[-1] != head_dim:
        raise ValueError(f"flashsys attention ({model}): query/key head dim {head_dim} and value head dim "
                         f"{v_head_dim} differ; flashsys needs one head dim")
    if head_dim > MAX_HEAD_DIM:
        raise ValueError(f"flashsys attention ({model}): head_dim {head_dim} is above flashsys' maximum "
                         f"{MAX_HEAD_DIM}")


def _key_mask_of_one_query(mask: Any, query: Tensor, key: Tensor) -> bool:
    """Whether `mask` is a (batch, 1, 1, keys) bool mask for one query per sequence that the decode kernels take (as
    `padding_mask` makes for a static cache): for one query it means what it means to `sdpa`."""
    return (isinstance(mask, Tensor) and mask.dtype == torch.bool and mask.dim() == 4 and query.shape[2] == 1
            and mask.shape == (query.shape[0], 1, 1, key.shape[2]) and _decodes(query, key, key))


def _decodes(query: Tensor, key: Tensor, value: Tensor) -> bool:
    """Whether a left-padded call can take `flash_attention_decode`: its group's rows fit a decode program, and no
    gradient is asked for (the decode op computes none; training runs the varlen kernels)."""
    return decode_fits(query.shape[2], query.shape[1] // key.shape[1]) and not grad_requested(query, key, value)


class _Packed:
    """Varlen arguments for a batch: offsets of each sequence's queries and keys in the flattened tokens, the longest
    of each, and (padding) which flattened rows are real tokens (None: all of them). `key_start`: for a left-padded
    batch decoding from a cache (a few real queries per row, at the end of its keys), each row's first real key, so
    that the decode kernels read the cache in place (None otherwise)."""

    __slots__ = ("cu_q", "cu_k", "max_q", "max_k", "rows_q", "rows_k", "key_start")

    def __init__(self, cu_q: Tensor, cu_k: Tensor, max_q: int, max_k: int, rows_q: Tensor | None = None,
                 rows_k: Tensor | None = None, key_start: Tensor | None = None) -> None:
        self.cu_q, self.cu_k, self.max_q, self.max_k = cu_q, cu_k, max_q, max_k
        self.rows_q, self.rows_k, self.key_start = rows_q, rows_k, key_start


def _split_rows(query: Tensor, key: Tensor, value: Tensor, attention_mask: Tensor | None, kwargs: dict,
                **options: Any) -> Tensor | None:
    """Attention over rows without a cache whose split the collator's offsets, a padding mask or restarting
    `position_ids` give (read inside a compiled graph too, once a step), or None where nothing splits them or the
    offsets are not both given (`_packed_rows` then decides). One position per row cannot be packed."""
    cu_q, cu_k = kwargs.get("cu_seq_lens_q"), kwargs.get("cu_seq_lens_k")
    if cu_q is not None and cu_k is not None:
        return flash_attention_packed(query, key, value, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, **options)
    if cu_q is not None or cu_k is not None:
        return None
    if attention_mask is not None:
        if attention_mask.shape[1] != key.shape[2]:
            return None
        return flash_attention_padded(query, key, value, attention_mask, **options)
    if kwargs.get("position_ids") is not None and query.shape[2] > 1:
        return flash_attention_packed(query, key, value, kwargs["position_ids"], **options)
    return None


def _packed_rows(kwargs: dict, attention_mask: Tensor | None, batch: int, n_q: int, n_k: int) -> _Packed | None:
    """How a batch with a cache and the collator's offsets or a padding mask splits into sequences, or None for
    whole rows (the dense kernels). Whole rows that no tensor has to be read to recognise (neither offsets nor a mask)
    are decided here, so that a compiled model does not break its graph at every layer there; the rest is read back,
    outside the graph (`_read_packed_rows`)."""
    if kwargs.get("cu_seq_lens_q") is None and kwargs.get("cu_seq_lens_k") is None and attention_mask is None:
        return None
    return _read_packed_rows(kwargs, attention_mask, batch, n_q, n_k)


@torch.compiler.disable  # reads the offsets or the mask back: outside a compiled graph
def _read_packed_rows(kwargs: dict, attention_mask: Tensor, batch: int, n_q: int, n_k: int) -> _Packed:
    cu_q, cu_k = kwargs.get("cu_seq_lens_q"), kwargs.get("cu_seq_lens_k")
    if cu_q is not None or cu_k is not None:
        return _from_offsets(cu_q, cu_k, kwargs.get("max_length_q"), kwargs.get("max_length_k"), batch * n_q,
                             batch * n_k)
    return read_once(attention_mask, f"padding of {batch} rows, {n_q} queries, {n_k} keys",
                     lambda mask: _from_padding(mask.bool(), n_q, n_k))


def _from_offsets(cu_q, cu_k, max_q, max_k, total_q: int, total_k: int) -> _Packed:
    if cu_q is None or cu_k is None:
        raise ValueError("flashsys attention: pass both cu_seq_lens_q and cu_seq_lens_k (a collator's packed offsets)")
    cu_q, cu_k = cu_q.to(torch.int32), cu_k.to(torch.int32)
    lengths_q, lengths_k = (cu[1:] - cu[:-1] for cu in (cu_q, cu_k))
    longest_q = int(lengths_q.max()) if max_q is None else int(max_q)
    longest_k = int(lengths_k.max()) if max_k is None else int(max_k)
    if int(cu_q[-1]) != total_q or int(cu_k[-1]) != total_k:
        raise ValueError(f"flashsys attention: cu_seq_lens_q/k end at {int(cu_q[-1])}/{int(cu_k[-1])}, but the batch "
                         f"holds {total_q}/{total_k} tokens; packed offsets index the flattened batch")
    return _Packed(cu_q, cu_k, longest_q, longest_k)


def _from_padding(mask: Tensor, n_q: int, n_k: int) -> _Packed:
    """The real tokens of a (B, n_k) padding mask, whose real keys must form one run per row (left or right
    padding); the queries are the last n_q positions, so their real ones end where the keys' run ends. Where every
    query is real and there is a cache (left-padded decoding), also each row's first real key."""
    if mask.shape[1] != n_k:
        raise ValueError(f"flashsys attention: the padding mask covers {mask.shape[1]} keys, the layer has {n_k}")
    runs = real_runs(mask)
    lengths_k = mask.sum(1, dtype=torch.int32)
    mask_q = mask[:, n_k - n_q:]
    lengths_q = mask_q.sum(1, dtype=torch.int32)
    summary = torch.stack([runs.max(), lengths_q.max(), lengths_k.max(), lengths_q.min()]).tolist()
    if summary[0] > 1:
        raise ValueError("flashsys attention: a row of the padding mask has padding between real tokens; flashsys "
                         "takes left or right padding (one run of real tokens per row)")
    zero = torch.zeros(1, dtype=torch.int32, device=mask.device)
    cu_q = torch.cat([zero, lengths_q.cumsum(0, dtype=torch.int32)])
    cu_k = torch.cat([zero, lengths_k.cumsum(0, dtype=torch.int32)])
    # Every query real: each row's one run of real keys takes in its last n_q keys, so it ends at the cache's end.
    decoding = n_q < n_k and summary[3] == n_q
    return _Packed(cu_q, cu_k, summary[1], summary[2], mask_q.reshape(-1).nonzero().view(-1),
                   mask.reshape(-1).nonzero().view(-1), n_k - lengths_k if decoding else None)
