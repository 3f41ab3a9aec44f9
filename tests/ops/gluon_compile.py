"""Compile every Gluon variant (the forward's, the dK/dV, dQ and one-pass backward kernels') for sm_90 without a GPU,
for every mask kind, and print what each compiled to as one JSON line ({variant and mask: "ok", or why it cannot run:
its compile failed, or it needs more shared memory than sm_90 has}). Run as a subprocess by test_gluon_forward (a
stand-in driver replaces Triton's for the whole process), or by hand:

    python -m tests.ops.gluon_compile

`scripts/gluon_ptx.py` compiles the same set to compare two versions' PTX.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator

import torch


def compiled_variants() -> Iterator[tuple[str, object]]:
    """(label, compiled kernel or the exception its compile raised) of every Gluon variant at each head dim and mask
    kind, on grouped-query K/V, Nq != Nk and lengths that are no multiple of a tile: the shapes the kernels mask.
    Installs the stand-in sm_90 driver where there is no GPU."""
    assert not os.environ.get("TRITON_INTERPRET"), "compiling needs Triton's compiler, not the interpreter"
    from flashsys.ops.attention import flash_gluon

    if not torch.cuda.is_available():
        from tests.ops.inductor_writes import _fake_cuda_driver

        _fake_cuda_driver()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    for d in flash_gluon.HEAD_DIMS:
        q = torch.randn(2, 4, 300, d, dtype=torch.bfloat16, device=device)
        k = torch.randn(2, 2, 200, d, dtype=torch.bfloat16, device=device)
        for mask, window in (("causal", (-1, 0)), ("full", (-1, -1)), ("window", (64, 16))):
            for variant in flash_gluon.gluon_variants(d):
                label = f"D {d} {mask} {variant.label()}"
                try:
                    compiled = flash_gluon.compile_only(variant, q, k, k, window, 0.125)
                except Exception as exc:  # noqa: BLE001  the caller shows which one failed and why
                    compiled = exc
                yield label, compiled


def verdict(kernel: object) -> str:
    """"ok", or why a variant cannot run: its compile failed, or it needs more shared memory than sm_90 gives a
    program (it compiles, and only its launch fails)."""
    from flashsys.ops.attention import flash_gluon

    if isinstance(kernel, Exception):
        return f"{type(kernel).__name__}: {str(kernel)[-1500:]}"
    if kernel.metadata.shared > flash_gluon.SM90_SHARED_BYTES:
        return f"needs {kernel.metadata.shared} bytes of shared memory, sm_90 allows {flash_gluon.SM90_SHARED_BYTES}"
    return "ok"


def main() -> None:
    print(json.dumps({label: verdict(kernel) for label, kernel in compiled_variants()}))


if __name__ == "__main__":
    main()
