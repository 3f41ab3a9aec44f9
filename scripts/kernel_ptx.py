"""Whether a source change altered the attention kernels' machine code, answered without a GPU.

Compiles every kernel for sm_90 (`tests/ops/kernel_compile.py`: the `tl` kernels, and every Gluon variant under every
mask kind; under a stand-in driver on a CPU), writes each kernel's PTX without its debug information (line numbers
move with any edit), and compares two such dumps:

    python scripts/kernel_ptx.py dump /tmp/before        # at the old code
    python scripts/kernel_ptx.py dump /tmp/after         # at the new code
    python scripts/kernel_ptx.py compare /tmp/before /tmp/after
    python scripts/kernel_ptx.py dump /tmp/after --group "D 128 one_pass"    # one group (kernel_compile --list)

`dump` also prints each kernel's shared memory, its registers and spills from Triton's bundled ptxas (for the
ping-pong kernels the launch's count; `setmaxnreg` then moves registers from the producer to the consumers), the
warpgroup barriers, local loads and the instruction mix (FP32, MUFU, tensor-core) in its SASS, and the local loads
and stores inside each tile loop (`tile_loop_local_memory`: the spills that cost every tile).
Each kernel is `identical`, `reordered` (the same instructions, registers renamed, in another order: read the diff
to see that the order does not matter, e.g. barrier initialisations before a fence; register names are erased, so
swapped operands read as reordered too) or `differs` (lines changed). The exit status is 0 where every kernel is
identical or reordered.
Run it under each Triton the kernels must work on (PYTHONPATH pointing at another Triton's install works).
"""

from __future__ import annotations

import argparse
import collections
import os
import re
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _code_lines(ptx: str) -> list[str]:
    """PTX without comments, `.loc`/`.file` lines, debug labels and the debug sections that follow the code."""
    lines = []
    for line in ptx.splitlines():
        stripped = line.strip()
        if stripped.startswith(".section") and "debug" in stripped:
            break
        if stripped.startswith(("//", ".loc", ".file")) or re.match(r"\$L__(tmp|func|info)", stripped):
            continue
        lines.append(re.sub(r"\$L__tmp\d+", "$L__tmp", line))
    return lines


def write_ptx(path: Path, ptx: str) -> None:
    """One kernel's PTX as `dump` keeps it: its code lines (`_code_lines`)."""
    path.write_text("\n".join(_code_lines(ptx)) + "\n")


def _ptxas_usage(ptx: Path) -> str:
    """Registers and spills of one kernel, as `ptxas -v` for sm_90a reports them."""
    from triton.backends.nvidia.compiler import get_ptxas

    r = subprocess.run([get_ptxas(90).path, "-arch=sm_90a", "-v", "-o", os.devnull, str(ptx)], capture_output=True,
                       text=True)
    found = re.search(r"Used (\d+) registers", r.stderr)
    spills = re.search(r"(\d+) bytes spill stores, (\d+) bytes spill loads", r.stderr)
    if r.returncode or not found:
        return f"ptxas failed: {r.stderr.strip()[-300:]}"
    return f"{found.group(1)} registers" + (f", spills {spills.group(1)}/{spills.group(2)} bytes stored/loaded"
                                            if spills and spills.group(1) != "0" else "")


_COUNTED = ("FFMA", "FMUL", "FADD", "MUFU", "HGMMA")


def _sass_counts(sass: str) -> str:
    """Barriers, local (spill) loads and the instructions that matter for attention in a kernel's SASS (Triton's
    cuobjdump), all partitions, prologue and epilogue included: a warpgroup barrier in a tile loop costs every tile,
    and the softmax runs on the FP32 pipe and the MUFU."""
    ops = collections.Counter(m.group(1).split(".")[0]
                              for m in re.finditer(r"^\S+\t(?:@!?U?P\w+\s+)?([A-Z][\w.]*)", sass, re.M))
    mix = ", ".join(f"{op} {ops[op]}" for op in _COUNTED if ops[op])
    return f"{sass.count('BAR.SYNC')} BAR.SYNC, {sass.count('LDL')} LDL" + (f", {mix}" if mix else "") + " in its SASS"


def tile_loop_local_memory(sass: str) -> list[tuple[int, int]]:
    """(local loads, local stores) in each tile loop of a kernel's SASS: each innermost loop (a branch back to a label
    above it) that issues tensor-core products. A spill there costs every tile, where the whole kernel's count
    (`_sass_counts`) mixes it with the prologue's and the epilogue's."""
    lines = sass.splitlines()
    labels = {m.group(1): i for i, line in enumerate(lines) if (m := re.match(r"^(\w+):\s*$", line))}
    loops = {(labels[m.group(1)], i) for i, line in enumerate(lines)
             if (m := re.search(r"\bBRA\s+(\w+)\s*;", line)) and labels.get(m.group(1), i) < i}
    products = [loop for loop in loops if any("HGMMA" in line for line in lines[loop[0]:loop[1]])]
    innermost = sorted(loop for loop in products
                       if not any(other != loop and loop[0] <= other[0] and other[1] <= loop[1] for other in products))

    def count(op: str, first: int, last: int) -> int:
        return sum(1 for line in lines[first:last + 1] if re.search(rf"\b{op}\b", line))

    return [(count("LDL", *loop), count("STL", *loop)) for loop in innermost]


def dump(out: Path, group: str | None = None) -> int:
    import triton

    from tests.ops.kernel_compile import compiled

    if out.is_dir() and any(out.glob("*.ptx")):
        raise SystemExit(f"kernel_ptx dump: {out} already holds .ptx files (an earlier dump's would be compared as "
                         "this one's): give an empty or new folder")
    out.mkdir(parents=True, exist_ok=True)
    failed = 0
    for label, kernel in compiled(group, all_masks=True):
        name = label.replace(" ", "_")
        if isinstance(kernel, Exception):
            failed += 1
            print(f"{name}: {type(kernel).__name__}: {str(kernel)[-500:]}")
            continue
        write_ptx(out / f"{name}.ptx", kernel.asm["ptx"])
        loops = ", ".join(f"{loads}/{stores}" for loads, stores in tile_loop_local_memory(kernel.asm["sass"]))
        print(f"{name}: {kernel.metadata.shared} bytes of shared memory, {_ptxas_usage(out / f'{name}.ptx')}, "
              f"{_sass_counts(kernel.asm['sass'])}; local loads/stores in its tile loops: {loops or 'no tile loop'}")
    print(f"triton {triton.__version__}: {failed} failed to compile")
    return 1 if failed else 0


def compare(before: Path, after: Path) -> int:
    for name, folder in (("before", before), ("after", after)):
        if not folder.is_dir() or not any(folder.glob("*.ptx")):
            raise SystemExit(f"kernel_ptx compare: {name} folder {folder} holds no .ptx files (run `dump` into it "
                             "first)")
    names = sorted({p.name for p in before.glob("*.ptx")} | {p.name for p in after.glob("*.ptx")})
    verdicts = collections.Counter()
    for name in names:
        if not (before / name).exists() or not (after / name).exists():
            verdict = "only in " + (str(before) if (before / name).exists() else str(after))
        else:
            a, b = ((d / name).read_text().splitlines() for d in (before, after))
            if a == b:
                verdict = "identical"
            else:
                unnamed = [collections.Counter(re.sub(r"%[a-z]+\d+", "%reg", line) for line in lines)
                           for lines in (a, b)]
                changed = sum(((unnamed[0] - unnamed[1]) + (unnamed[1] - unnamed[0])).values())
                verdict = "reordered" if changed == 0 else f"differs ({changed} lines)"
        verdicts[verdict.split(" (")[0]] += 1
        print(f"{name}: {verdict}")
    print(", ".join(f"{n} {v}" for v, n in sorted(verdicts.items())))
    return 0 if set(verdicts) <= {"identical", "reordered"} else 1


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="command", required=True)
    dumper = sub.add_parser("dump", help="compile every kernel and write <label>.ptx files")
    dumper.add_argument("out", type=Path)
    dumper.add_argument("--group", help="one group of tests/ops/kernel_compile.py (default: all)")
    cmp = sub.add_parser("compare", help="compare two dumps kernel by kernel")
    cmp.add_argument("before", type=Path)
    cmp.add_argument("after", type=Path)
    args = p.parse_args()
    return dump(args.out, args.group) if args.command == "dump" else compare(args.before, args.after)


if __name__ == "__main__":
    sys.exit(main())
