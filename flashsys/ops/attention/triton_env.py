"""Whether Triton is here, and whether it runs kernels in its CPU interpreter, without importing the kernels.

Triton is imported lazily: the tiled PyTorch op, the modules and the trainer work where Triton is not installed
(macOS, Windows, a CPU-only machine), and only the Triton op asks for it.
"""

from __future__ import annotations

import functools
import importlib.metadata
import importlib.util
import os
import re


def env_switch(name: str) -> bool:
    """A flashsys on/off environment variable: unset, 1, true, on or yes is on (every switch defaults to on); 0,
    false, off or no is off. Anything else raises, naming the variable, rather than being read as either."""
    value = os.environ.get(name, "1").strip().lower()
    if value in ("1", "true", "on", "yes"):
        return True
    if value in ("0", "false", "off", "no"):
        return False
    raise ValueError(f"{name}={os.environ[name]!r}: set it to 0 (off) or 1 (on)")


def fp_fusion_by_default() -> bool:
    """Whether Triton fuses a multiply and an add into one FMA where a launch does not say: its default up to 3.9
    (3.9 warns that 3.10 turns it off). Read from Triton's knobs without asking `fp_fusion_enabled`, which warns.
    The kernels write their scores' scale-and-shift as an explicit FMA where this is False (a multiply and an add
    each, unfused, doubled the forward's FP32 instructions)."""
    import triton

    language = getattr(getattr(triton, "knobs", None), "language", None)
    if language is None or not hasattr(language, "default_fp_fusion"):
        return os.environ.get("TRITON_DEFAULT_FP_FUSION", "1") == "1"
    return bool(language.default_fp_fusion) and not getattr(language, "force_disable_fp_fusion", False)


def autotune_enabled() -> bool:
    """FLASHSYS_TRITON_AUTOTUNE (on by default): time every candidate config on a key's first call; off, and under the
    interpreter, take the first candidate."""
    return env_switch("FLASHSYS_TRITON_AUTOTUNE") and not interpreter_active()


def interpreter_active() -> bool:
    """True when Triton runs kernels on the CPU (TRITON_INTERPRET=1)."""
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


@functools.cache
def triton_problem() -> str | None:
    """None when Triton can be imported, else why not (without importing it; looked up once per process)."""
    try:
        found = importlib.util.find_spec("triton") is not None
    except (ImportError, ValueError):  # ValueError: a module set to None in sys.modules, as a test does
        found = False
    return None if found else "Triton is not installed (pip install triton; it ships for Linux)"


def _release(package: str) -> tuple[int, int] | None:
    """(major, minor) of an installed package's version, None where it is not installed or reads otherwise."""
    try:
        found = re.match(r"(\d+)\.(\d+)", importlib.metadata.version(package))
    except importlib.metadata.PackageNotFoundError:
        return None
    return (int(found[1]), int(found[2])) if found else None


@functools.cache
def interpreter_problem() -> str | None:
    """None unless this Triton's interpreter cannot run the kernels, else why: before Triton 3.7 the interpreter
    turns a loop bound into an int by converting a one-element array, which NumPy refuses from 2.4 on, so every
    kernel that loops over tiles fails with "only 0-dimensional arrays can be converted to Python scalars"
    (triton-lang/triton#9171). Read from the installed versions, without importing either; once per process."""
    triton, numpy = _release("triton"), _release("numpy")
    if triton is None or numpy is None or triton >= (3, 7) or numpy < (2, 4):
        return None
    return (f"Triton {triton[0]}.{triton[1]}'s interpreter cannot run with NumPy {numpy[0]}.{numpy[1]} "
            "(triton-lang/triton#9171): install triton>=3.7 or numpy<2.4")


def check_interpreter(op: str, alternative: str) -> None:
    """Raise where the interpreter cannot run the kernels (`interpreter_problem`), offering `alternative`: the check of
    every interpreted call's entry point.

    Raises:
        RuntimeError: naming the versions to install and `alternative`.
    """
    if (problem := interpreter_problem()) is not None:
        raise RuntimeError(f"{op}: {problem}; or use {alternative}")
