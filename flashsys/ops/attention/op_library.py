"""Where flashsys' opaque torch.library ops are defined: one `flashsys::` library, and the overload name every op
takes, a digest of the attention package's source.

Why a digest in the name: Inductor keeps compiled graphs in an on-disk cache (kept across runs, and across upgrades
of flashsys) keyed by the graph's code, in which an opaque op appears by name only. The op's fake kernel, which gave
the shapes the cached code was compiled for, is not part of the key: a graph compiled before a change to an op's
outputs (a plan that grew a field) would be found again and run with the old shapes. With the digest in the name,
changed code defines differently named ops, and graphs that call the old ones are not found. Callers call the op
`define_op` returns, not its packet (`torch.ops.flashsys.find_padding`): a traced graph records the packet as it is
called, and a packet's name has no overload, so graphs would be keyed without the digest. The `triton_op`s of
`library_ops` need none: a compiled graph holds their traced bodies, whose Triton kernels' sources are part of
Inductor's key. The digest costs about 1 ms at import (reading the package's ~40 source files once).
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Sequence
from pathlib import Path

import torch

NAMESPACE = "flashsys"


def source_digest(root: Path) -> str:
    """A short digest of every .py file under `root` (paths and contents): an overload name (letters and digits,
    starting with a letter)."""
    digest = hashlib.sha256()
    for path in sorted(root.rglob("*.py")):
        digest.update(path.relative_to(root).as_posix().encode())
        digest.update(path.read_bytes())
    return "v" + digest.hexdigest()[:12]


OVERLOAD = source_digest(Path(__file__).parent)
_LIBRARY = torch.library.Library(NAMESPACE, "FRAGMENT")


def define_op(name: str, schema: str, body: Callable, fake: Callable,
              tags: Sequence[torch.Tag] = ()) -> torch._ops.OpOverload:
    """Define `flashsys::name.OVERLOAD` with `schema` (its arguments and returns, "(Tensor q, ...) -> Tensor"), `body`
    for CPU and CUDA alike (CompositeExplicitAutograd: no autograd kernel, the ops are called inside autograd
    Functions and never differentiated themselves) and `fake` for torch.compile's shapes; returns the op."""
    _LIBRARY.define(f"{name}.{OVERLOAD}{schema}", tags=tuple(tags))
    _LIBRARY.impl(f"{name}.{OVERLOAD}", body, "CompositeExplicitAutograd")
    torch.library.register_fake(f"{NAMESPACE}::{name}.{OVERLOAD}", fake, lib=_LIBRARY)
    return getattr(getattr(torch.ops.flashsys, name), OVERLOAD)
