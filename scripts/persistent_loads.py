"""How evenly the persistent forward's programs share a causal forward's work (CPU; prints). The work of a query tile
is counted as its key tiles plus one; each program's total is divided by the mean over programs. Two orders:
- one by one: program p runs tiles p, p + P, p + 2P, ... (a head's heaviest tile first), as at f2e8941;
- pairs (`gluon_kernels._persistent_tile`): program p runs units p, p + P, ...; a unit is one head's k-th query tile
  from the end and k-th from the start.
The numbers kernel_experiments.md (stop 40) quotes:

    python scripts/persistent_loads.py --programs 132
"""

from __future__ import annotations

import argparse


def tile_work(pid_m: int, block_m: int, block_n: int) -> int:
    """Key tiles a causal query tile visits (square, Nq = Nk), plus one for the tile's own start and end."""
    return -(-((pid_m + 1) * block_m) // block_n) + 1


def loads(n_bh: int, n_m_tiles: int, programs: int, paired: bool, block_m: int = 128, block_n: int = 128
          ) -> list[int]:
    load = [0] * programs
    if paired:
        half = (n_m_tiles + 1) // 2
        for unit in range(n_bh * half):
            k = unit % half
            for pid_m in {n_m_tiles - 1 - k, k}:
                load[unit % programs] += tile_work(pid_m, block_m, block_n)
    else:
        for tile in range(n_bh * n_m_tiles):
            pid_m = n_m_tiles - 1 - tile % n_m_tiles
            load[tile % programs] += tile_work(pid_m, block_m, block_n)
    return load


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--programs", type=int, default=132, help="programs (SMs); an H100 SXM has 132")
    args = ap.parse_args()
    print("N (16k tokens, 16 heads, 128-row tiles) | busiest program / mean: one by one | pairs")
    for n in (1024, 2048, 4096, 8192, 16384):
        n_bh, n_m_tiles = 16 * (16384 // n), n // 128
        row = []
        for paired in (False, True):
            work_items = n_bh * ((n_m_tiles + 1) // 2 if paired else n_m_tiles)  # the grid: min(items, SMs)
            load = loads(n_bh, n_m_tiles, min(args.programs, work_items), paired)
            row.append(max(load) / (sum(load) / len(load)))
        print(f"{n} | {row[0]:.2f} | {row[1]:.2f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
