"""Repeated eager attention calls replayed cheaply: `plans` records the first call of a signature and replays its
launches from Python; `native` replays the same plans from C++ with a C++ autograd node (its extension built by
`builder`, in a process of its own, from `csrc/native_launch.cpp`).

Why: at the sizes of a layer in a small model an eager attention call costs more host time than GPU time;
docs/host-cost.md has the measurements.
"""

from __future__ import annotations


def clear() -> None:
    """Forget every plan: the eager forwards', the backwards', the compiled graphs' opaque ops' and the native
    launcher's copies. For a change that plans do not key on (flashsys's determinism switch, a test forcing
    another kernel variant): clearing only the Python tables would leave the native launcher replaying the old
    kernels in eager calls while compiled calls choose anew."""
    from . import native, plans

    for table in (plans.forward_plans, plans.backward_plans, plans.op_forward_plans, plans.decode_plans):
        table.clear()
    native.clear()
