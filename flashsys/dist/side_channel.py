"""Host-side checks beside a process group's collectives, each bounded by that group's own timeout.

- `control_group(group)`: a gloo group over the same ranks, for small CPU exchanges that must never pair with a
  collective still pending on `group` itself (whatever went wrong there).
- `Arrivals`: every rank meets, through the rendezvous store, before a collective that a rank could skip (an
  optimizer step, a state-dict consolidation). A rank that does not arrive within the timeout is named in an error
  on every rank that did, instead of a hang or an opaque transport timeout.
"""

from __future__ import annotations

import datetime
import itertools

import torch
import torch.distributed as dist

DEFAULT_TIMEOUT = datetime.timedelta(minutes=30)  # torch's own default for gloo groups


def group_timeout(group=None) -> datetime.timedelta:
    """The collective timeout `group` (default: the world) was created with; torch's default if it cannot be read."""
    pg = group if group is not None else dist.distributed_c10d._get_default_group()
    for device in ("cpu", "cuda"):
        try:
            return pg._get_backend(torch.device(device)).options._timeout
        except (AttributeError, RuntimeError):
            continue
    return DEFAULT_TIMEOUT


def control_group(group=None):
    """A new gloo group over `group`'s ranks with `group`'s timeout (a collective: every rank of the world calls it,
    in the same order). torch would give it a 30-minute timeout of its own."""
    ranks = None if group is None else dist.get_process_group_ranks(group)
    return dist.new_group(ranks=ranks, backend="gloo", timeout=group_timeout(group))


def _store():
    try:
        return dist.distributed_c10d._get_default_store()
    except (AttributeError, RuntimeError, ValueError):
        return None


class Arrivals:
    """A meeting point of `group`'s ranks in front of the collectives of `owner` (a name for messages).

    Each `check(what)` posts this rank's arrival in the rendezvous store and waits, up to the group's timeout, for
    every other rank's arrival at the same call. Costs three round trips to the store per check. Instances must be
    created in the same order on every rank (as the collectives they guard are).
    """

    _instances = itertools.count()

    def __init__(self, owner: str, group=None) -> None:
        self.owner = owner
        self.ranks = dist.get_process_group_ranks(group) if group is not None else list(range(dist.get_world_size()))
        self.rank = dist.get_rank()
        self.timeout = group_timeout(group)
        self.prefix = f"flashsys/arrivals/{next(Arrivals._instances)}"
        self.calls = 0
        self.store = _store() if len(self.ranks) > 1 else None

    def _key(self, call: int, rank: int) -> str:
        return f"{self.prefix}/{call}/{rank}"

    def check(self, what: str) -> None:
        """Wait until every rank has arrived at this call.

        Raises:
            RuntimeError: naming `owner.what` and the ranks that did not arrive within the timeout, or the ranks
                that arrived at another call in its place.
        """
        if self.store is None:
            return
        call, self.calls = self.calls, self.calls + 1
        keys = [self._key(call, r) for r in self.ranks]
        self.store.set(self._key(call, self.rank), what)
        try:
            self.store.wait(keys, self.timeout)
        except Exception:  # the store's timeout error type differs between torch releases
            missing = [r for r, key in zip(self.ranks, keys) if not self.store.check([key])]
            raise RuntimeError(
                f"{self.owner}.{what}: rank(s) {missing} did not arrive within {self.timeout.total_seconds():g} s. It "
                "is a collective: every rank must call it, the same number of times."
            ) from None
        multi_get = getattr(self.store, "multi_get", None)  # one round trip; older stores lack it: no comparison
        calls = [c.decode() for c in multi_get(keys)] if multi_get is not None else [what]
        if len(set(calls)) > 1:
            detail = ", ".join(f"rank {r}: {c}" for r, c in zip(self.ranks, calls))
            raise RuntimeError(f"{self.owner}: the ranks called different collectives ({detail}); every rank must "
                               "make the same calls in the same order.")
        if call:
            self.store.delete_key(self._key(call - 1, self.rank))  # every rank is past that call
