"""Compile flashsys's attention kernels for sm_90 without a GPU (a stand-in driver names the target) and say what each
compiled to. The CPU tests run it per group in subprocesses (`test_gluon_forward`), `scripts/kernel_ptx.py` to compare
two versions' machine code; by hand:

    python -m tests.ops.kernel_compile                      # every group: {label: "ok" or why not} as JSON
    python -m tests.ops.kernel_compile --group "D 128 one_pass"
    python -m tests.ops.kernel_compile --native-packing      # each Gluon kind's launch as the native launcher packs it

Groups: "tl" (the `tl` kernels: forward, dQ, dK/dV at D 64 and 128, bf16 and fp32, three masks, dense and varlen; the
one pass's prologue and epilogue; the decode kernels in each tiling), and one per Gluon (head dim, stage). A Gluon group compiles every variant under a
causal mask, and its stage's first variant of each kind under a full mask and a window too: the masks select code
paths (the paired order, the rotated ring and its dQ fold, the window's bounds), the variants tile sizes and buffers.
Forward variants on trial (`dispatch.FORWARD_TRIALS`) compile under a full mask too, the cells they are tried for.
`--all-masks` compiles every variant under every mask.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import re
from collections.abc import Callable, Iterator

import torch

MASKS = (("causal", (-1, 0)), ("full", (-1, -1)), ("window", (64, 16)))
_STAGES = {"forward": ("plain", "pingpong", "persistent"), "dkdv": ("dkdv",), "dq": ("dq",),
           "one_pass": ("one_pass", "one_pass_det")}


def _setup() -> str:
    """The device the kernels compile for: a CUDA GPU, or a CPU under the stand-in sm_90 driver."""
    assert not os.environ.get("TRITON_INTERPRET"), "compiling needs Triton's compiler, not the interpreter"
    if torch.cuda.is_available():
        return "cuda"
    from tests.ops.inductor_writes import _fake_cuda_driver

    _fake_cuda_driver()
    return "cpu"


def groups() -> list[str]:
    """Every group's name, "tl" first."""
    from flashsys.ops.attention import dispatch

    names = ["tl"]
    for d in dispatch.HEAD_DIMS:
        kinds = {v.kind for v in dispatch.gluon_variants(d)}
        names += [f"D {d} {stage}" for stage, members in _STAGES.items() if kinds & set(members)]
    return names


def _jit(handle):
    """The JITFunction under an autotuner."""
    while type(handle).__name__ != "JITFunction":
        handle = handle.fn
    return handle


def _tl_kernels(device: str) -> Iterator[tuple[str, Callable[[], object]]]:
    from flashsys.ops.attention import launcher
    from flashsys.ops.attention.gluon.launch import dq_sum_rows
    from flashsys.ops.attention.triton import kernels, launch

    for d in (64, 128):
        for dtype in (torch.bfloat16, torch.float32):
            for mask, window in MASKS[:2] + (("window", (16, 0)),):
                for varlen in (False, True):
                    q = torch.randn(2, 4, 100, d, dtype=dtype, device=device)
                    k = torch.randn(2, 2, 80, d, dtype=dtype, device=device)
                    with launch.recording() as launches:
                        if varlen:
                            qq, kk = (x[0].transpose(0, 1).contiguous() for x in (q, k))
                            cu = torch.tensor([0, 30, 80], dtype=torch.int32, device=device)
                            o, lse = launcher.varlen_forward(qq, kk, kk, launcher.Offsets(cu, cu), (50, 50), window,
                                                             0.125)
                            launcher.varlen_backward(qq, kk, kk, o, lse, torch.randn_like(qq), launcher.Offsets(cu, cu),
                                                     (50, 50), window, 0.125)
                        else:
                            o, lse, _ = launcher.forward(q, k, k, window, 0.125, traced=True)
                            launcher.backward(q, k, k, o, lse, torch.randn_like(q), window, 0.125, traced=True)
                    for kernel, (handle, args, constexprs, _), _grid in launches:
                        config = handle.configs[0]
                        meta = {**config.kwargs, "num_warps": config.num_warps, "num_stages": config.num_stages}
                        label = f"tl {kernel} D{d} {str(dtype)[6:]} {mask} {'varlen' if varlen else 'dense'}"
                        yield label, (lambda h=handle, a=args, c=constexprs, m=meta:
                                      _jit(h).warmup(*a, **c, **m, grid=(1,)))
        batch, heads, n = 2, 4, 100
        o = torch.randn(batch, heads, n, d, dtype=torch.bfloat16, device=device)
        lse = torch.randn(batch, heads, n, device=device)
        pairs = torch.empty(batch, heads, n, 2, device=device)
        acc = torch.empty(batch, heads, dq_sum_rows(n), d, device=device)
        sem = torch.empty(batch * heads * 2, dtype=torch.int32, device=device)
        for zero_all in (False, True):
            args = launch.positional(kernels.one_pass_prologue_kernel, dict(
                O=o, DO=o, L=lse, LseDelta=pairs, DqAcc=acc, Sem=sem, n_heads=heads, n_q=n, n_sum=acc.shape[2]))
            yield (f"tl prologue D{d} {'all' if zero_all else 'unseen'}",
                   lambda a=args, z=zero_all, d=d: kernels.one_pass_prologue_kernel.warmup(
                       *a, HEAD_DIM=d, BLOCK_D=d, ROWS=64, ZERO_ALL=z, grid=(1,)))
        args = launch.positional(kernels.one_pass_epilogue_kernel, dict(
            DqAcc=acc, DQ=o, n_rows=batch * heads * n, n_heads=heads, n_q=n, n_sum=acc.shape[2], softmax_scale=0.125))
        yield (f"tl epilogue D{d}", lambda a=args, d=d: kernels.one_pass_epilogue_kernel.warmup(
            *a, HEAD_DIM=d, BLOCK_D=d, ROWS=64, grid=(1,)))


def _decode_kernels(device: str) -> Iterator[tuple[str, Callable[[], object]]]:
    """The launches `decode.forward` makes (recorded, not run), at D 64 and 128, with and without per-row cache
    starts, for batches that take each of its paths on CPU_PROGRAMS stand-in SMs: keys split and combined (2 programs),
    one whole-SM split (4), and the shared-SM tilings at three (8) and two (12) stages."""
    from flashsys.ops.attention.triton import decode, launch

    for d in (64, 128):
        for batch, kv_heads in ((1, 2), (1, 4), (2, 4), (3, 4)):
            q = torch.randn(batch, 4 * kv_heads, 1, d, dtype=torch.bfloat16, device=device)
            k = torch.randn(batch, kv_heads, 700, d, dtype=torch.bfloat16, device=device)
            o, lse = torch.empty_like(q), torch.empty(q.shape[:-1], device=device)
            for key_start in (None, torch.zeros(batch, dtype=torch.int32, device=device)):
                with launch.recording() as launches:
                    decode.forward(q, k, k, o, lse, (-1, 0), d ** -0.5, traced=False, key_start=key_start)
                for name, (kernel, args, constexprs, _), _grid in launches:
                    what = (f"{constexprs['BLOCK_N']} keys {constexprs['num_stages']} stages "
                            f"{'direct' if constexprs['DIRECT'] else 'split'}"
                            f"{' starts' if constexprs['HAS_KEY_START'] else ''}") if "BLOCK_N" in constexprs else ""
                    stage = name.removeprefix("flash_decode_").removesuffix("_kernel")
                    yield (f"tl decode {stage} D{d} {what}".rstrip(),
                           lambda h=kernel, a=args, c=constexprs: h.warmup(*a, **c, grid=(1,)))


def _gluon_kernels(device: str, head_dim: int, stage: str, all_masks: bool
                   ) -> Iterator[tuple[str, Callable[[], object]]]:
    """Grouped-query K/V, Nq != Nk and lengths that are no multiple of a tile: the shapes the kernels mask."""
    from flashsys.ops.attention import dispatch
    from flashsys.ops.attention.gluon import launch as gluon_launch

    q = torch.randn(2, 4, 300, head_dim, dtype=torch.bfloat16, device=device)
    k = torch.randn(2, 2, 200, head_dim, dtype=torch.bfloat16, device=device)
    variants = [v for v in dispatch.gluon_variants(head_dim) if v.kind in _STAGES[stage]]
    firsts = {next(v for v in variants if v.kind == kind) for kind in {v.kind for v in variants}}
    trials = set(dispatch.FORWARD_TRIALS.get(head_dim, ())) if stage == "forward" else set()
    for mask, window in MASKS:
        for variant in variants:
            if mask == "causal" or all_masks or variant in firsts or (mask == "full" and variant in trials):
                yield (f"D {head_dim} {mask} {variant.label()}",
                       lambda v=variant, w=window: gluon_launch.compile_only(v, q, k, k, w, 0.125))


def compiled(group: str | None = None, all_masks: bool = False) -> Iterator[tuple[str, object]]:
    """(label, compiled kernel or the exception its compile raised) of every kernel of `group` (every group where
    None)."""
    device = _setup()
    for name in groups() if group is None else [group]:
        if name == "tl":
            kernels = itertools.chain(_tl_kernels(device), _decode_kernels(device))
        else:
            _, d, stage = name.split(" ")
            kernels = _gluon_kernels(device, int(d), stage, all_masks)
        for label, compile_one in kernels:
            try:
                result = compile_one()
            except Exception as exc:  # noqa: BLE001  the caller shows which one failed and why
                result = exc
            yield label, result


def verdict(kernel: object, label: str = "") -> str:
    """"ok", or why a kernel cannot run: its compile failed, or it needs more shared memory than sm_90 gives a program
    (it compiles, and only its launch fails); or, for a Gluon forward (label "D .. <mask> plain|pingpong|persistent
    .."), why it would run slowly: a key tile's softmax that does not run under its P V product
    (`exponentials_under_pv`), or one that spills a tile's worth of registers there (`local_memory_under_pv`)."""
    from flashsys.ops.attention.gluon.launch import SM90_SHARED_BYTES

    if isinstance(kernel, Exception):
        return f"{type(kernel).__name__}: {str(kernel)[-1500:]}"
    if kernel.metadata.shared > SM90_SHARED_BYTES:
        return f"needs {kernel.metadata.shared} bytes of shared memory, sm_90 allows {SM90_SHARED_BYTES}"
    if clashes := named_barrier_clashes(kernel.asm["ptx"]):
        return f"Triton's own named barriers reach the forward's: {clashes}"
    if label.startswith("D ") and label.split(" ")[3] in _STAGES["forward"]:
        counts = exponentials_under_pv(kernel.asm["sass"])
        if not counts or min(counts) < MIN_EXPONENTIALS_UNDER_PV:
            return (f"the softmax does not run under P V: exponentials between each wait for S and the wait for "
                    f"P V {counts} (want {MIN_EXPONENTIALS_UNDER_PV} or more each)")
        spilled = local_memory_under_pv(kernel.asm["sass"])
        if max(spilled) > MAX_LOCAL_MEMORY_UNDER_PV:
            return (f"spills in the softmax: local-memory loads and stores between each wait for S and the wait for "
                    f"P V {spilled} (want {MAX_LOCAL_MEMORY_UNDER_PV} or fewer each)")
    return "ok"


def named_barrier_clashes(ptx: str) -> list[str]:
    """The named-barrier instructions of a kernel's PTX that use an id from the ping-pong forward's own
    (`named_barriers.FIRST_ID` on) without being one of them (`literal_barriers`: a turn's id and thread count; a
    slot's id is a register): Triton numbers the barriers of its warp partitions from 0, and one of its own that
    reached those ids would complete a turn or a slot early, or hang it."""
    found = re.findall(r"\b(?:bar|barrier)\.(?:sync|arrive|red)(?:\.\w+)*\s+(\d+)(?:,\s*(\d+))?", ptx)
    if not found:
        return []
    from flashsys.ops.attention.gluon.named_barriers import FIRST_ID, literal_barriers

    ours = {(str(i), str(n)) for i, n in literal_barriers()}
    return sorted({f"id {i}, {n or 'all'} threads" for i, n in found if int(i) >= FIRST_ID and (i, n) not in ours})


# A forward's thread computes (tile rows x key columns) / 128 exponentials a tile: 32 for the smallest tiles
# (64 x 64 per warpgroup).
MIN_EXPONENTIALS_UNDER_PV = 32


def exponentials_under_pv(sass: str) -> list[int]:
    """For each wait in a kernel's SASS that lets one warpgroup MMA run on (`WARPGROUP.DEPBAR.LE gsb0, 0x1`: the
    forward's wait for S_t, P_{t-1} V_{t-1} still running), the MUFU.EX2 instructions before the next wait for every
    MMA (0x0, that P V's). The forward issues S_t and P_{t-1} V_{t-1} together so that S_t's softmax runs while the
    tensor cores finish P V; ptxas moves a wait up to the start of its basic block, and with the softmax in the same
    block as the P V wait, this count was 0."""
    return _count_under_pv(sass, r"MUFU\.EX2")


def _count_under_pv(sass: str, instruction: str) -> list[int]:
    """The lines matching `instruction` between each `WARPGROUP.DEPBAR.LE gsb0, 0x1` and the next `0x0`."""
    counts, running = [], None
    for line in sass.splitlines():
        if "WARPGROUP.DEPBAR.LE gsb0, 0x1" in line:
            running = 0
        elif running is not None and "WARPGROUP.DEPBAR.LE gsb0, 0x0" in line:
            counts.append(running)
            running = None
        elif running is not None and re.search(instruction, line):
            running += 1
    return counts


# A float32 P carried across the key loop made three-warpgroup consumers (160 registers) spill 125-185 values in each
# softmax; a scalar or two spilling (0-7 under Triton 3.9's ptxas) costs little.
MAX_LOCAL_MEMORY_UNDER_PV = 16


def local_memory_under_pv(sass: str) -> list[int]:
    """For each softmax of a forward's SASS (as `exponentials_under_pv` finds them), its local-memory loads and stores
    (LDL, STL): register spills, since the attention kernels keep no arrays in local memory."""
    return _count_under_pv(sass, r"\b(?:LDL|STL)\b")


class _Loaded:
    """A compiled kernel as a GPU process holds it once loaded (a function handle), for packing its launch on a CPU:
    `CompiledKernel` loads its binary when indexed by a grid or asked for its function, which needs a GPU."""

    def __init__(self, compiled):
        self.metadata, self.src, self.asm, self.function = compiled.metadata, compiled.src, compiled.asm, 0x1

    def __getitem__(self, grid):
        return None


def _tritons_encoding(descriptor, meta: dict) -> tuple[tuple, list]:
    """What this Triton's launcher does with a host descriptor: (cuTensorMapEncodeTiled's arguments as its C side
    derives them from the fill function's: dtype, dims and byte strides innermost first, box, swizzle, fill; base
    address left out) and the parameters it passes after the map. The fill function is stood in for (it needs a GPU)."""
    import inspect

    import triton
    from triton.backends.nvidia import driver as nvidia_driver

    seen = []

    class Utils:
        def fill_tma_descriptor_tiled(self, ptr, swizzle, elem_size, elem_type, block, shape, strides, padding):
            seen.append((swizzle, elem_size, elem_type, list(block), list(shape), list(strides), padding))
            return "map"

        fill_tma_descriptor = fill_tma_descriptor_tiled  # its name before Triton 3.7

    active = triton.runtime.driver.active
    active.utils = Utils()
    try:
        extra = (None,) * (len(inspect.signature(nvidia_driver.make_tensordesc_arg).parameters) - 2)
        passed = nvidia_driver.make_tensordesc_arg(descriptor, meta, *extra)
    finally:
        del active.utils
    (swizzle, elem_size, elem_type, block, shape, strides, padding), = seen
    assert passed[0] == "map"
    return ((elem_type, shape[::-1], [elem_size * s for s in strides[-2::-1]], block[::-1], swizzle, padding),
            list(passed[1:]))


def native_packing(head_dim: int) -> Iterator[tuple[str, str]]:
    """(label, "ok" or what disagrees) for the first variant of each Gluon kind at `head_dim`, causal: its launch as
    `replay.native.cuda_launch_spec` packs it from a plan's replay (`gluon.launch.GluonReplay`), against the
    compiled kernel's PTX parameters and against what Triton's own launcher would pass for each descriptor."""
    from flashsys.ops.attention import dispatch
    from flashsys.ops.attention.gluon import launch as gluon_launch
    from flashsys.ops.attention.replay import native, plans

    device = _setup()
    q = torch.randn(2, 4, 300, head_dim, dtype=torch.bfloat16, device=device)
    k = torch.randn(2, 2, 200, head_dim, dtype=torch.bfloat16, device=device)
    firsts = {}
    for variant in dispatch.gluon_variants(head_dim):
        firsts.setdefault(variant.kind, variant)
    for variant in firsts.values():
        label = f"D {head_dim} causal {variant.label()}"
        parts = gluon_launch.parts_for_compile(variant, q, k, k, (-1, 0), 0.125)
        compiled = parts.kernel.warmup(*parts.args, **parts.kwargs, grid=(1,))
        params, n = parts.parameters(), len(parts.sources)
        replay = gluon_launch.GluonReplay(_Loaded(compiled), parts.grid, params, n)
        spec = native.cuda_launch_spec(plans.Replay(replay, tuple(range(n)), (), None, None))
        yield label, _packing_verdict(spec, compiled, parts, params)


def _packing_verdict(spec, compiled, parts, params) -> str:
    from flashsys.ops.attention.replay import native

    if spec is None:
        return "the native launcher refused the launch"
    _, grid, threads, shared, words, pointers, _, maps = spec
    ptx = native.ptx_parameters(compiled.asm["ptx"])
    if len(words) != len(ptx):
        return f"{len(words)} words for {len(ptx)} PTX parameters"
    if (grid, threads, shared) != ((*parts.grid, 1, 1)[:3], 32 * compiled.metadata.num_warps, compiled.metadata.shared):
        return f"grid, threads, shared {grid, threads, shared}"
    if sorted(m[0] for m in maps) != [i for i, t in enumerate(ptx) if t == native.TENSOR_MAP]:
        return f"tensor maps at {[m[0] for m in maps]}, PTX {ptx}"
    descriptors = [(i, p) for i, p in enumerate(params[:len(parts.sources)]) if not isinstance(p, torch.Tensor)]
    if len(descriptors) != len(maps) or len(pointers) != len(parts.sources) - len(maps):
        return f"{len(maps)} maps and {len(pointers)} pointers for {len(parts.sources)} tensors"
    for (slot, descriptor), meta, (param, map_slot, *encoding) in zip(descriptors, compiled.metadata.tensordesc_meta,
                                                                       maps):
        if map_slot != slot or descriptor.base.data_ptr() != parts.sources[slot].data_ptr():
            return f"parameter {param}: the map of slot {map_slot} for descriptor {slot}"
        expected, after = _tritons_encoding(descriptor, meta)
        if tuple(encoding) != expected:
            return f"parameter {param}: encoded as {encoding}, Triton's launcher {expected}"
        rank = len(descriptor.shape)
        packed = words[param + 1:param + 1 + 2 * rank]
        if packed != [x & ((1 << (32 if i < rank else 64)) - 1) for i, x in enumerate(after)]:
            return f"parameter {param}: shape and strides {packed}, Triton's launcher {after}"
    return "ok"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--group", help="one group (`--list` shows them); every group by default")
    p.add_argument("--all-masks", action="store_true", help="every Gluon variant under every mask")
    p.add_argument("--list", action="store_true", help="print the groups and exit")
    p.add_argument("--native-packing", action="store_true",
                   help="each Gluon kind's launch as the native launcher packs it, against Triton's launcher")
    args = p.parse_args()
    if args.list:
        print("\n".join(groups()))
        return
    if args.native_packing:
        from flashsys.ops.attention import dispatch

        print(json.dumps({label: why for d in dispatch.HEAD_DIMS for label, why in native_packing(d)}))
        return
    if args.group is not None and args.group not in groups():
        p.error(f"--group must be one of {groups()}, got {args.group!r}")
    print(json.dumps({label: verdict(kernel, label) for label, kernel in compiled(args.group, args.all_masks)}))


if __name__ == "__main__":
    main()
