"""Repeated eager attention calls launched from C++, with a C++ autograd node (csrc/native_launch.cpp).

Why: a planned eager call (`plans`) still pays for Python's autograd.Function (most of it the backward waiting for
the GIL on the autograd engine's device thread) and Triton's Python launcher. SDPA pays neither (docs/host-cost.md).
The C++ side looks plans up by the same signature, allocates the outputs, encodes the Gluon kernels' TMA descriptors
on the call's tensors, launches the kernels with cuLaunchKernel and records a C++ autograd node whose backward does
the same without the GIL. It replays only what the Python path did for that exact signature; a signature it has no
plan for returns to the Python path (forward: `forward` gives None; backward: `backward_fallback`), which makes the
plan and offers it here. A compiled graph's opaque ops (`library_ops`: the Gluon kernels, which Inductor cannot
launch itself) replay their plans here too, without a node (`op_forward`, `op_backward`): their Python bodies are
then a look-up and a call.

The extension is compiled on first use (torch.utils.cpp_extension with ninja and a C++ compiler, no CUDA toolkit:
it opens libcuda with dlopen and takes the driver's types from Triton's bundled cuda.h), in a background thread, so
no call waits for it: until it is ready, calls take the Python path. The build itself runs in a process of its own
(`builder` says why) and is reused by every later process, which imports it directly.
`FLASHSYS_NATIVE_LAUNCH=0` turns it off; `status()` says where it stands. A kernel whose launch needs anything
cuLaunchKernel alone does not give (Triton's scratch buffers, clusters, launch hooks set by a profiler) stays with
Triton's launcher.
"""

from __future__ import annotations

import contextlib
import functools
import os
import re
import struct
import subprocess
import sys
import threading
import warnings
from pathlib import Path
from typing import Callable

import torch
from torch import Tensor

from ..gluon.launch import GluonReplay
from ..triton_env import env_switch
from . import builder, plans

SOURCE = Path(__file__).with_name("csrc") / "native_launch.cpp"
EXTENSION_NAME = "flashsys_native_launch"  # the module's name, and its build directory's (`build_directory`)
ENV = "FLASHSYS_NATIVE_LAUNCH"
_MAX_SHARED = 227 * 1024  # larger needs a launch attribute cuLaunchKernel does not take

_module = None  # the compiled extension, once loaded
_status = "not built"
_lock = threading.Lock()
_thread: threading.Thread | None = None
_backward_fallback: Callable | None = None
_suspended = False


def enabled() -> bool:
    """FLASHSYS_NATIVE_LAUNCH, an on/off switch (triton_env.env_switch: a value other than on or off raises)."""
    return env_switch(ENV)


def status() -> str:
    """'ready', 'building', 'not built', 'off (FLASHSYS_NATIVE_LAUNCH=...)' or 'failed: <reason>'."""
    return f"off ({ENV}={os.environ.get(ENV)})" if not enabled() else _status


def set_backward_fallback(fn: Callable) -> None:
    """fn(q, k, v, o, lse, do, window_left, window_right, scale) -> (dq, dk, dv): the backward of a native
    forward whose backward signature has no plan yet (`flash_triton` gives its planned backward)."""
    global _backward_fallback
    _backward_fallback = fn
    if _module is not None:
        _module.set_backward_fallback(fn)


_CFLAGS = ["-O2"]


def _cuda_include() -> Path:
    """Triton's bundled CUDA headers: the driver API's types, for a build with no CUDA toolkit."""
    import triton

    include = Path(triton.__file__).parent / "backends" / "nvidia" / "include"
    if not (include / "cuda.h").exists():
        raise RuntimeError(f"no cuda.h in {include}")
    return include


def build_directory() -> Path:
    """Where this source builds: named by a hash of everything the library depends on (the source, the flags,
    torch's, Python's and Triton's versions), under torch's extensions root (TORCH_EXTENSIONS_DIR or its default), so
    a change of any of them builds afresh and nothing else has to compare versions."""
    import hashlib

    import triton

    key = hashlib.sha256(SOURCE.read_bytes())
    for part in (*_CFLAGS, str(_cuda_include()), torch.__version__, str(torch.version.git_version), sys.version,
                 triton.__version__):
        key.update(b"\0" + part.encode())
    return Path(_extensions_root()) / f"{EXTENSION_NAME}_{key.hexdigest()[:16]}"


def _extensions_root() -> str:
    """torch's extensions root: TORCH_EXTENSIONS_DIR, else the per-user cache that
    `torch.utils.cpp_extension.get_default_build_root` returns, read without importing that module. Its import
    holds the GIL for ~0.1 s, which stalls the first eager calls of a process whose build is complete."""
    if os.environ.get("TORCH_EXTENSIONS_DIR"):
        return os.environ["TORCH_EXTENSIONS_DIR"]
    try:
        from torch._appdirs import user_cache_dir  # what get_default_build_root reads
    except ImportError:  # pragma: no cover - a torch that moved it
        from torch.utils.cpp_extension import get_default_build_root

        return get_default_build_root()
    return os.path.realpath(user_cache_dir(appname="torch_extensions"))


def _import_built(directory: Path):
    """The extension a completed build left in `directory`, imported as torch's loader imports it, or None where no
    build completed there."""
    import importlib.util

    library = builder.completed(directory, EXTENSION_NAME)
    if library is None:
        return None
    spec = importlib.util.spec_from_file_location(EXTENSION_NAME, library)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _build_elsewhere(directory: Path) -> None:
    """Run builder.py (which says why a process of its own) in a new session and wait for it: the wait
    releases the GIL. Raises with the builder's message where it failed."""
    command = [sys.executable, builder.__file__, "--name", EXTENSION_NAME, "--source", str(SOURCE),
               "--include", str(_cuda_include()), "--directory", str(directory), *(f"--cflag={f}" for f in _CFLAGS)]
    done = subprocess.run(command, capture_output=True, text=True, start_new_session=True)
    if done.returncode != 0:
        raise RuntimeError(done.stderr.strip() or f"{builder.__file__} exited with {done.returncode}")


def _load_or_build():
    directory = build_directory()
    module = _import_built(directory)
    if module is None:
        _build_elsewhere(directory)
        module = _import_built(directory)
        if module is None:
            raise RuntimeError(f"the build reported success but left no completed library in {directory}")
    return module


def _build() -> None:
    global _module, _status
    try:
        module = _load_or_build()
        if _backward_fallback is not None:
            module.set_backward_fallback(_backward_fallback)
        _module, _status = module, "ready"
    except Exception as e:  # noqa: BLE001 - any build failure leaves the Python path, said once
        lines = str(e).strip().splitlines() or [""]
        reason = next((line for line in lines if "error:" in line), lines[-1])  # the compiler's first error
        _status = f"failed: {type(e).__name__}: {reason.strip()}"
        warnings.warn(f"flashsys: the native launcher for eager attention did not build ({_status}); eager calls "
                      f"take the Python path, about 1.6x SDPA's host time per call. {ENV}=0 skips the build.",
                      RuntimeWarning, stacklevel=2)


def start_build() -> None:
    """Build (or load the cached build of) the extension in a background thread, once per process."""
    global _thread, _status
    if not enabled():
        return
    with _lock:
        if _thread is None:
            _status = "building"
            _thread = threading.Thread(target=_build, name="flashsys-native-launch-build", daemon=True)
            _thread.start()


def wait(timeout: float | None = None) -> bool:
    """Start the build if needed and wait for it; True when the native launcher is ready."""
    start_build()
    if _thread is not None:
        _thread.join(timeout)
    return _module is not None


def allow_interpreted(allowed: bool) -> None:
    """Let CPU tensors (Triton's interpreter) take the native node too: how CPU tests run it. Off by default:
    interpreted calls gain nothing from it."""
    if _module is not None:
        _module.allow_interpreted(allowed)
    elif allowed:
        raise RuntimeError(f"flashsys native launcher not ready ({status()})")


@contextlib.contextmanager
def suspended():
    """Calls inside take the Python path (the Python plans' replays), in every thread: to compare the two launchers, or
    to rule this one out. Native nodes made before still run their backward natively."""
    global _suspended
    before, _suspended = _suspended, True
    try:
        yield
    finally:
        _suspended = before


def clear() -> None:
    if _module is not None:
        _module.clear()


def sizes() -> tuple[int, int, int]:
    """(eager forward plans, backward plans, compiled graphs' forward op plans) the native tables hold."""
    return (0, 0, 0) if _module is None else tuple(_module.sizes())


try:  # a profiler's launch hooks (Triton >= 3.4 keeps them in knobs; older ones on CompiledKernel)
    from triton import knobs as _knobs

    _hooks = _knobs.runtime
except ImportError:  # pragma: no cover - old Triton
    from triton.compiler import CompiledKernel as _hooks


def _hook_set(hook) -> bool:
    # Triton 3.9 keeps a chain of hooks (empty unless a profiler added one); older ones a function or None.
    return hook is not None and bool(getattr(hook, "calls", True))


def _launch_hooks_set() -> bool:
    return _hook_set(_hooks.launch_enter_hook) or _hook_set(_hooks.launch_exit_hook)


def _replaying():
    """The extension, where a call may replay through it now (built, not suspended, no launch hooks), else None."""
    module = _module
    return None if module is None or _suspended or _launch_hooks_set() else module


def forward(q: Tensor, k: Tensor, v: Tensor, is_causal, softmax_scale, window_size) -> Tensor | None:
    """O from a native plan for this call's signature, or None (no plan, not ready, or a call the Python path
    must take: traced, tensor subclasses, functorch, forward-mode AD, dispatch modes, launch hooks)."""
    if (module := _replaying()) is None or not plans.plannable(q, k, v, is_causal, softmax_scale, window_size):
        return None
    try:
        return module.forward(q, k, v, is_causal, softmax_scale, window_size)
    except TypeError:  # a flag outside C++'s types (an int beyond 64 bits): the Python path validates it
        return None


def op_forward(window: tuple[int, int], scale: float, q: Tensor, k: Tensor, v: Tensor
               ) -> tuple[Tensor, Tensor] | None:
    """(O, L) for a compiled graph's opaque forward op from a native plan of its signature (`library_ops`), or None
    (no plan, not ready, suspended, launch hooks set)."""
    module = _replaying()
    return None if module is None else module.op_forward(window[0], window[1], scale, q, k, v)


def op_backward(window: tuple[int, int], scale: float, q: Tensor, k: Tensor, v: Tensor, o: Tensor, lse: Tensor,
                do: Tensor) -> tuple[Tensor, Tensor, Tensor] | None:
    """(dQ, dK, dV) for a compiled graph's opaque backward op (dO of any strides) from the native backward plan of its
    signature, the one an eager backward of the same tensors replays; None as `op_forward`."""
    module = _replaying()
    return None if module is None else module.op_backward(window[0], window[1], scale, q, k, v, o, lse, do)


def _offer(plan, register: Callable[[list], None]) -> None:
    """Convert a plan's launches once and, unless a launch is refused, `register` them with the extension. Where the
    extension refuses them (a driver without what a launch needs: `cuTensorMapEncodeTiled` before CUDA 12), the plan
    stays with the Python path, said once as a warning."""
    if _module is None or _suspended or plan is None or plan.native is not None:
        return
    specs = launch_specs(plan.replays)
    plan.native = specs is not None
    if specs is None:
        return
    try:
        register(specs)
    except (ValueError, RuntimeError) as exc:  # slower, not wrong
        plan.native = False
        _warn_once(str(exc), f"flashsys: the native launcher refused a plan ({exc}); its calls keep the Python path")


def offer_forward(plan: plans.ForwardPlan | None, q: Tensor, k: Tensor, v: Tensor, is_causal,
                  softmax_scale, window_size) -> None:
    """Give the native side a forward plan the Python path made or replayed (once per plan)."""
    _offer(plan, lambda specs: _module.add_forward(q, k, v, is_causal, softmax_scale, window_size, specs,
                                                    list(plan.lse_shape), *plan.window, float(plan.scale),
                                                    _scratch_specs(plan.scratch)))


def offer_op_forward(plan: plans.ForwardPlan | None, window: tuple[int, int], scale: float, q: Tensor, k: Tensor,
                     v: Tensor) -> None:
    """Give the native side a compiled graph's opaque forward plan (`plans.op_forward_plans`'), once per plan."""
    _offer(plan, lambda specs: _module.add_op_forward(*window, float(scale), q, k, v, specs, list(plan.lse_shape),
                                                       _scratch_specs(plan.scratch)))


def offer_backward(plan: plans.BackwardPlan | None, window: tuple[int, int], scale: float, q: Tensor,
                   k: Tensor, v: Tensor, o: Tensor, lse: Tensor, do: Tensor) -> None:
    """As `offer_forward`, for a backward plan of (q, k, v, O, L as unpacked, the dense dO)."""
    _offer(plan, lambda specs: _module.add_backward(*window, float(scale), q, k, v, o, lse, do, specs,
                                                     list(plan.delta_shape), _scratch_specs(plan.scratch)))


def _scratch_specs(scratch: tuple[tuple[tuple[int, ...], torch.dtype], ...]) -> list[tuple[list[int], str]]:
    """A plan's scratch tensors as the extension takes them: (shape, dtype name) each."""
    return [(list(shape), str(dtype).removeprefix("torch.")) for shape, dtype in scratch]


_warned: set[str] = set()  # what `_warn_once` said


def _warn_once(key: str, message: str) -> None:
    """A RuntimeWarning, once per process for each `key` (a kernel, a refusal): the Python path runs on, only slower."""
    if key not in _warned:
        _warned.add(key)
        warnings.warn(message, RuntimeWarning, stacklevel=4)


def launch_specs(replays: tuple[plans.Replay, ...]) -> list[tuple] | None:
    """The native side's launch of each of a plan's replays (`cuda_launch_spec`'s, or a Python launch it calls under
    the GIL), or None where one needs more than it can give (said once per kernel, as a warning)."""
    specs = []
    for r in replays:
        gluon = isinstance(r.run, GluonReplay)
        if r.kernel is None and not gluon:  # the interpreter's launch: Python's
            specs.append(_python_launch(r))
            continue
        spec = cuda_launch_spec(r)
        if spec is None and gluon:  # a Triton whose descriptors the native side does not encode: its own launcher
            spec = _python_launch(r)
        if spec is None:
            kernel = r.run.compiled if gluon else r.kernel
            name = getattr(getattr(kernel, "src", None), "name", None) or repr(kernel)
            _warn_once(name, f"flashsys: the native launcher cannot launch {name} (its launch needs more than "
                             "cuLaunchKernel takes, or its PTX and signature disagree); calls of it keep the Python path")
            return None
        specs.append(spec)
    return specs


def _python_launch(replay: plans.Replay) -> tuple:
    """A replay as a launch the native side calls under the GIL: (run, slots, tail)."""
    return (replay.run, list(replay.slots), tuple(replay.tail))


_INT_BITS = {"i8": 8, "u8": 8, "i16": 16, "u16": 16, "i32": 32, "u32": 32, "i64": 64, "u64": 64}
_PTX_BYTES = {"u8": 1, "s8": 1, "b8": 1, "u16": 2, "s16": 2, "b16": 2, "u32": 4, "s32": 4, "b32": 4,
              "u64": 8, "s64": 8, "b64": 8, "f32": 4}
# A TMA descriptor parameter (`.param .align 64 .b8 name[128]`): 128 bytes the launch copies from the host.
TENSOR_MAP = "tensormap"
_PARAMETER = re.compile(r"\.param\s+(?:\.align\s+(\d+)\s+)?\.(\w+)[^\[,]*?(?:\[(\d+)\])?\s*$")


@functools.lru_cache(maxsize=512)
def ptx_parameters(ptx: str) -> tuple[str, ...] | None:
    """The PTX types of a kernel's parameters, in order ('u64', 'u32', 'f32', ..., TENSOR_MAP for a TMA descriptor):
    what cuLaunchKernel reads, Triton's hidden scratch pointers included. None when the PTX has not exactly one
    entry, or declares a parameter of another kind."""
    entries = re.findall(r"\.entry\s+[\w$]+\s*\((.*?)\)", ptx, re.S)
    if len(entries) != 1:
        return None
    types = []
    for declaration in filter(str.strip, entries[0].split(",")):
        m = _PARAMETER.match(declaration.strip())
        if m is None:
            return None
        align, ty, count = m.groups()
        if count is None and align is None:
            types.append(ty)
        elif (ty, count, align) == ("b8", "128", "64"):
            types.append(TENSOR_MAP)
        else:
            return None
    return tuple(types)


# The TMA element-type numbers Triton's compiler records (`tensordesc_meta`) and the driver's CUtensorMapDataType
# for them, which differ in three places: as Triton's launcher maps them (nvidia/driver.py).
_TMA_DTYPE_DEVICE_TO_HOST = {8: 10, 9: 8, 10: 9}
_OOB_FILL_NONE, _OOB_FILL_NAN = 0, 1  # CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE, ..._NAN_REQUEST_ZERO_FMA
_MAX_TENSOR_MAP_RANK = 5


def tensor_map(template, meta: dict | None) -> tuple | None:
    """The arguments cuTensorMapEncodeTiled takes for a Gluon descriptor `template` (its base left out: each call
    gives its own), as Triton's launcher derives them from the descriptor and the compiler's `meta` for it:
    (data type, dims innermost first, byte strides of every dim but the innermost, innermost first, box innermost
    first, swizzle, out-of-bounds fill). None where the launcher would do more than encode a tiled map (im2col,
    packed fp4, float32 rounded to tf32) or where there is no such meta (the descriptor was lowered to a pointer)."""
    if meta is None or meta.get("fp4_padded") or meta.get("is_im2col") or getattr(template, "round_f32_to_tf32", False):
        return None
    shape, strides, block = list(template.shape), list(template.strides), list(meta["block_size"])
    rank = len(shape)
    if not 0 < rank <= _MAX_TENSOR_MAP_RANK or len(strides) != rank or len(block) != rank or strides[-1] != 1:
        return None
    elem_size = meta["elem_size"]
    fill = _OOB_FILL_NAN if getattr(template, "padding", "zero") == "nan" else _OOB_FILL_NONE
    return (_TMA_DTYPE_DEVICE_TO_HOST.get(meta["elem_type"], meta["elem_type"]), shape[::-1],
            [elem_size * s for s in strides[-2::-1]], block[::-1], meta["swizzle"], fill)


def cuda_launch_spec(replay: plans.Replay) -> tuple | None:
    """(function, grid, threads, shared bytes, words, [(parameter, slot)], kernel, [tensor map]) for
    cuLaunchKernel: one 8-byte word per PTX parameter, packed from the kernel's Triton signature and the replay's
    arguments; the compiled kernel (kept alive with the plan: it owns the function); for a Gluon replay
    (`GluonReplay`), each TMA descriptor as (parameter, slot, *`tensor_map`), encoded on the slot's tensor at every
    launch, its shape and strides packed after it as Triton's launcher passes them. None where the launch needs more
    than cuLaunchKernel takes, or the signature and the PTX do not agree."""
    slots = replay.slots
    if isinstance(replay.run, GluonReplay):
        kernel, grid = replay.run.compiled, replay.run.grid
        values = [*replay.run.templates, *replay.run.rest]
    else:
        kernel, grid = replay.kernel, replay.grid
        values = [None] * len(slots) + list(replay.tail)
    md = getattr(kernel, "metadata", None)
    if (md is None or getattr(md, "num_ctas", 1) != 1 or getattr(md, "launch_pdl", False)
            or getattr(md, "launch_cooperative_grid", False) or getattr(md, "global_scratch_size", 0)
            or getattr(md, "profile_scratch_size", 0) or md.shared > _MAX_SHARED
            or getattr(kernel, "function", None) is None):
        return None
    types = list(kernel.src.signature.values())
    params = ptx_parameters(kernel.asm.get("ptx", ""))
    metas = list(getattr(md, "tensordesc_meta", None) or ())
    n_descriptors = sum(isinstance(ty, str) and ty.startswith("tensordesc") for ty in types)
    if params is None or len(types) != len(values) or len(metas) not in (0, n_descriptors):
        return None
    words, pointers, maps = [], [], []

    def take(ptx_type: str) -> bool:  # the next PTX parameter is of this type
        return len(words) < len(params) and params[len(words)] == ptx_type

    for i, (ty, value) in enumerate(zip(types, values)):
        if ty == "constexpr":
            continue
        if isinstance(ty, str) and ty.startswith("tensordesc"):
            encode = tensor_map(value, metas.pop(0) if metas else None) if i < len(slots) else None
            if encode is None or not take(TENSOR_MAP):
                return None
            maps.append((len(words), slots[i], *encode))
            words.append(0)
            for size in value.shape:  # as the launcher passes them after the map: i32 sizes, then i64 strides
                if not take("u32"):
                    return None
                words.append(size & 0xFFFFFFFF)
            for stride in value.strides:
                if not take("u64"):
                    return None
                words.append(stride & 0xFFFFFFFFFFFFFFFF)
            continue
        if len(words) >= len(params):
            return None
        ptx = params[len(words)]
        if isinstance(ty, str) and ty.startswith("*") and i < len(slots) and value is None and ptx == "u64":
            pointers.append((len(words), slots[i]))
            words.append(0)
        elif ty in _INT_BITS and type(value) is int and _PTX_BYTES.get(ptx) == _INT_BITS[ty] // 8:
            words.append(value & ((1 << _INT_BITS[ty]) - 1))
        elif ty in ("fp32", "f32") and type(value) in (float, int) and ptx == "f32":
            words.append(struct.unpack("<I", struct.pack("<f", value))[0])
        else:
            return None
    extras = params[len(words):]  # Triton's scratch pointers: null, as its launcher passes them at size 0
    if any(p != "u64" for p in extras):
        return None
    words.extend(0 for _ in extras)  # more words or maps than csrc holds: it refuses the plan (`_offer`)
    return (kernel.function, tuple(grid), 32 * md.num_warps, md.shared, words, pointers, kernel, maps)
