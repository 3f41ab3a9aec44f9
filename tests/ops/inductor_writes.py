"""Which kernel arguments Inductor's mutation analysis thinks each flashsys kernel writes.

Under torch.compile a `wrap_triton` launch is functionalized from this analysis of the kernel's TTIR: a tensor it
counts as written is cloned before the launch and copied back after it, and when that tensor is a leaf that
requires grad, compilation fails ("a leaf Variable that requires grad is being used in an in-place operation").
Run as a script (`python -m tests.ops.inductor_writes`): prints {kernel (case): sorted written names} as JSON.
It needs Triton's compiler, not its interpreter; without a GPU it generates TTIR for an sm_90 target.
"""

from __future__ import annotations

import json
import os

import torch


def _fake_cuda_driver() -> None:
    """TTIR generation asks the active driver for its target, and `JITFunction.warmup` (a compile to SASS, no launch)
    also for a device and a stream: stand one in on a CPU machine. tests/ops/kernel_compile.py uses it too."""
    import triton
    from triton.backends.compiler import GPUTarget

    class CompileOnly:
        def get_current_target(self):
            return GPUTarget("cuda", 90, 32)

        def get_current_device(self):
            return 0

        def get_current_stream(self, device=None):
            return 0

    triton.runtime.driver.set_active(CompileOnly())


def _analysis():
    """torch's analysis entry point: identify_accessed_tensors (newer, returns reads and writes) or
    identify_mutated_tensors (older, returns the written names)."""
    import torch._higher_order_ops.triton_kernel_wrap as wrap

    if hasattr(wrap, "identify_accessed_tensors"):
        return lambda kernel, kwargs: sorted(d.name for d in wrap.identify_accessed_tensors(kernel, kwargs, {})
                                             .read_writes.writes)
    return lambda kernel, kwargs: sorted(wrap.identify_mutated_tensors(kernel, kwargs, {}))


def main() -> None:
    assert not os.environ.get("TRITON_INTERPRET"), "the analysis needs compiled Triton, not the interpreter"
    if not torch.cuda.is_available():
        _fake_cuda_driver()
    from flashsys.ops.attention import launcher
    from flashsys.ops.attention.triton import launch

    device = "cuda" if torch.cuda.is_available() else "cpu"
    written = {}
    analyse = _analysis()
    cases = {
        "dense causal": lambda: (torch.randn(2, 4, 64, 64), torch.randn(2, 4, 64, 64), (-1, 0), None),
        "gqa window": lambda: (torch.randn(1, 4, 64, 64), torch.randn(1, 2, 80, 64), (16, 0), None),
        "varlen": lambda: (torch.randn(64, 4, 64), torch.randn(64, 2, 64), (-1, -1),
                           torch.tensor([0, 24, 64], dtype=torch.int32)),
    }
    for case, make in cases.items():
        q, k, window, cu = make()
        q, k = q.to(device), k.to(device)

        with launch.recording() as launches:  # nothing runs: each launch is prepared and recorded
            if cu is None:
                o, lse, _ = launcher.forward(q, k, k, window, 0.125, traced=True)
                launcher.backward(q, k, k, o, lse, torch.randn_like(q), window, 0.125, traced=True)
            else:
                offsets = launcher.Offsets(cu.to(device), cu.to(device))
                o, lse = launcher.varlen_forward(q, k, k, offsets, (40, 40), window, 0.125)
                launcher.varlen_backward(q, k, k, o, lse, torch.randn_like(q), offsets, (40, 40), window, 0.125)
        for kernel, (handle, args, constexprs, _), _grid in launches:
            kwargs = {**dict(zip(handle.fn.arg_names, args)), **constexprs}
            written[f"{kernel} ({case})"] = analyse(handle, kwargs)
    print(json.dumps(written))


if __name__ == "__main__":
    main()
