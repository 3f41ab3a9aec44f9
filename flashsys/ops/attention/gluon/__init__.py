"""Attention kernels for Hopper GPUs (sm_90) in Gluon, Triton's lower-level language, and their host side.

- `common`, `compat`: helpers every kernel shares, and the Gluon names that moved between Triton versions.
- `forward`: three forward kernels (one warpgroup, ping-pong, persistent).
- `named_barriers`: the ping-pong forward's hand-offs (turns, K/V slots) as named hardware barriers.
- `backward`: the two-pass backward's dK/dV and dQ kernels.
- `one_pass`: the whole backward in one pass (FlashAttention-3's layout), deterministic or not.
- `launch`: kernel configurations (`Variant`), TMA descriptors, launches and their replays.
- `kernel_set`: every kernel in one module, what `kernels()` returns.

Which calls take these kernels, and which variant runs, is `..dispatch`'s decision. Importing the kernels needs a
Triton with Gluon's Hopper API (3.6 or later): `kernels()` imports them on first use and says None where they do not
import, so the `tl` kernels run instead.
"""

from __future__ import annotations

from types import ModuleType

# Plain module state, not functools.cache: Dynamo traces `kernels()` (through `dispatch.forward_problem`) under
# torch.compile and warns about every functools cache it traces through.
_loaded: list = []  # [the kernels' namespace, or None], once tried
_import_error: list[str] = []  # why they do not import here, once tried


def kernels() -> ModuleType | None:
    """The Gluon kernels (`kernel_set`: `attention_forward`, `attention_forward_pingpong`,
    `attention_forward_persistent`, `attention_backward_dkdv`, `attention_backward_dq`,
    `attention_backward_one_pass`) and Gluon's language module `gl`, or None where they do not import with this
    Triton (`import_error()` says why). Imported once."""
    if not _loaded:
        try:
            from . import kernel_set
        except (ImportError, AttributeError, TypeError) as exc:  # no Gluon, or an API that moved since Triton 3.9
            _import_error.append(f"the Gluon kernels do not import with this Triton ({type(exc).__name__}: {exc})")
            kernel_set = None
        _loaded.append(kernel_set)
    return _loaded[0]


def import_error() -> str | None:
    """Why the Gluon kernels do not import here, or None where they do (or have not been asked for yet)."""
    return _import_error[0] if _import_error else None
