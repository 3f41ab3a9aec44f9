"""A list-scheduling model of the deterministic one pass's launch orders under a causal mask (no GPU): programs start
in launch order as SMs free up, one per SM, and a program of key tile n visits T - n query tiles (a unit each, and
one unit per program). It shows why the masked order's tail is hard to avoid while each head launches its key
tiles from the last down: the last program launched is always a heaviest one. Splitting the last head's heaviest
tiles in two shortens that tail in the model; built and timed, the split was not faster (kernel_experiments.md,
stop 42). The paired order (stop 52, kept) launches every other group of heads heaviest first, so that each SM's
program of an odd group starts as its even-group program ends and the two add up to about the same on every SM
(`flash_triton._paired_key_program`; the turns that let its heaviest-first groups wait only for programs launched
before them are the kernel's, not modelled here).

    python scripts/one_pass_launch_model.py --heads 16 --key-tiles 128 --sms 132
"""

from __future__ import annotations

import argparse
import heapq


def makespan(work: list[float], sms: int) -> float:
    """When the last of `work`'s programs ends, each started in order on the first SM to free up."""
    free = [0.0] * sms
    end = 0.0
    for w in work:
        start = heapq.heappop(free)
        heapq.heappush(free, start + w)
        end = max(end, start + w)
    return end


def head(tiles: int, split_at: int | None = None, split_cost: float = 2.0) -> list[float]:
    """One head's programs, from the last key tile down; with `split_at`, a tile that visits more query tiles
    becomes two programs (the upper piece first), each paying `split_cost` for its partial dK/dV hand-over."""
    work = []
    for n in reversed(range(tiles)):
        visits = tiles - n
        if split_at is not None and visits > split_at:
            work += [visits - split_at + 1 + split_cost, split_at + 1 + split_cost]
        else:
            work.append(visits + 1)
    return work


def paired(heads: int, tiles: int, sms: int) -> list[float]:
    """The paired order's programs: groups of max(1, sms // tiles) heads, key tile by key tile across a group's
    heads, even groups from the last key tile down, odd groups from key tile 0 up."""
    group = max(1, sms // tiles)
    work = []
    for g, first in enumerate(range(0, heads, group)):
        order = range(tiles) if g % 2 else reversed(range(tiles))
        work += [tiles - n + 1 for n in order for _ in range(first, min(heads, first + group))]
    return work


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--key-tiles", type=int, default=128)
    ap.add_argument("--sms", type=int, default=132)
    args = ap.parse_args()
    h, t, sms = args.heads, args.key_tiles, args.sms
    mean = sum(sum(head(t)) for _ in range(h)) / sms
    heaviest_first = [t - n + 1 for _ in range(h) for n in range(t)]
    print(f"{h} heads x {t} key tiles on {sms} SMs; mean load {mean:.0f} units")
    print(f"  heaviest first (the unordered one pass):        {makespan(heaviest_first, sms):.0f}")
    print(f"  lightest first, head after head (deterministic): {makespan(head(t) * h, sms):.0f}")
    print(f"  paired (both kinds, causal masks):               {makespan(paired(h, t, sms), sms):.0f}")
    for split in (1, 2, h):
        work = [w for i in range(h) for w in head(t, t // 2 if i >= h - split else None)]
        print(f"  the last {split:2d} head(s)' tiles past {t // 2} query tiles split in two:  {makespan(work, sms):.0f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
