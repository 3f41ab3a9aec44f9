"""Every attention implementation flashsys can run, by name: the one vocabulary of the ops, the modules, the
command line and the benchmarks.

Each entry computes the same function, `attention(q, k, v, causal, softmax_scale, window_size=None) -> O`, over
(B, N, D) or (B, H, N, D) tensors (k, v may have fewer heads than q: grouped-query attention), and says whether it
can run on a given device. The core entries are what a model
picks from; the others pin one SDPA kernel or add `torch.compile`, for benchmarks that compare them.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal

import torch
import torch.nn.functional as F
from torch import Tensor

from .flash_torch import FlashAttention2Torch
from .reference import attention_reference, window_mask
from .triton_env import interpreter_active, interpreter_problem, triton_problem

AttentionFn = Callable[..., Tensor]  # (q, k, v, causal, softmax_scale, window_size=None) -> O


@dataclass(frozen=True)
class AttentionBackend:
    """One named implementation.

    Args:
        name: the registry key.
        fn: `fn(q, k, v, causal, softmax_scale, window_size=None) -> O`; window_size is flash-attn's (left, right).
        description: one line for `flashsys info` and `--help`.
        runs_on: "any" device, "cuda" only, or "triton": CUDA, or a CPU with TRITON_INTERPRET=1 set before
            import (Triton's interpreter: slow, for tests).
        core: True for the implementations a model chooses between; False for benchmark variants.
        module: a module the backend imports (an optional package): "not installed" where it does not import.
    """

    name: str
    fn: AttentionFn
    description: str
    runs_on: str = "any"
    core: bool = True
    module: str | None = None

    def unavailable_reason(self, device: torch.device | str) -> str | None:
        """None when this backend can run on `device`, else why not (without running it)."""
        on_cuda = torch.device(device).type == "cuda"
        if self.module is not None:
            import importlib.util

            try:
                found = importlib.util.find_spec(self.module) is not None
            except (ImportError, ValueError):
                found = False
            if not found:
                return f"not installed ({self.module})"
        if self.runs_on == "cuda" and not on_cuda:
            return "needs CUDA"
        if self.runs_on == "triton":
            if (problem := triton_problem()) is not None:
                return problem
            if not (on_cuda or interpreter_active()):
                return "needs CUDA, or TRITON_INTERPRET=1 set before import (slow, for tests)"
            if not on_cuda and (problem := interpreter_problem()) is not None:
                return problem
        return None

    def __call__(self, q: Tensor, k: Tensor, v: Tensor, causal: bool = False, softmax_scale: float | None = None,
                 window_size: tuple[int, int] | None = None) -> Tensor:
        return self.fn(q, k, v, causal, softmax_scale, window_size)


def flash_runs_triton(name: str, q: Tensor) -> bool:
    """Whether the flash entry `name` ("flash", "flash-triton" or "flash-torch") runs the Triton kernels for q:
    "flash" does on CUDA tensors and runs the tiled PyTorch op elsewhere."""
    return name == "flash-triton" or (name == "flash" and isinstance(q, Tensor) and q.device.type == "cuda")


def _flash_auto(q, k, v, causal, scale, window=None):
    """Triton on CUDA tensors, the tiled PyTorch op elsewhere."""
    if flash_runs_triton("flash", q):
        return _flash_triton(q, k, v, causal, scale, window)
    return FlashAttention2Torch.apply(q, k, v, causal, scale, window)


def _flash_triton(q, k, v, causal, scale, window=None):
    from . import triton_op  # imports Triton on first use only

    return triton_op().apply(q, k, v, causal, scale, window)


def _flash_torch(q, k, v, causal, scale, window=None):
    return FlashAttention2Torch.apply(q, k, v, causal, scale, window)


def _naive(q, k, v, causal, scale, window=None):
    return attention_reference(q, k, v, causal, scale, window)[0]


def _sdpa(kernel: str | None) -> AttentionFn:
    """SDPA, letting PyTorch choose its kernel (`kernel=None`) or pinned to one. Grouped K/V go through
    `enable_gqa`. SDPA's own causal mask is aligned top-left, so a causal mask with Nq != Nk, and any window, are
    passed as an explicit boolean mask with flash-attn's bottom-right alignment (not every SDPA kernel takes one)."""

    def run(q, k, v, causal, scale, window=None):
        left, right = window if window is not None else (-1, -1)
        if causal:
            right = 0
        explicit = left >= 0 or (right >= 0 and not (causal and right == 0 and q.shape[-2] == k.shape[-2]))
        options = dict(scale=scale, enable_gqa=q.dim() == 4 and q.shape[1] != k.shape[1])
        if explicit:
            options["attn_mask"] = window_mask(q.shape[-2], k.shape[-2], left, right, q.device)
        else:
            options["is_causal"] = causal
        if kernel is None:
            return F.scaled_dot_product_attention(q, k, v, **options)
        from torch.nn.attention import SDPBackend, sdpa_kernel

        with sdpa_kernel(getattr(SDPBackend, kernel)):
            return F.scaled_dot_product_attention(q, k, v, **options)

    return run


def _fa4(deterministic: bool) -> AttentionFn:
    """FlashAttention-4 (flash-attn-4's CuTe DSL kernels), the benchmarks' same-run anchor: (B, N, H, D) layout, so
    rank-4 inputs go through transposed views (no copies). Its backward adds dQ in no fixed order unless
    `deterministic` (its own semaphore-ordered backward), the anchor for flashsys's default, bit-deterministic one."""

    def run(q, k, v, causal, scale, window=None):
        from flash_attn.cute import flash_attn_func

        if window is not None and window != (-1, -1):
            raise ValueError("fa4 anchor: windows are not wired here")
        squeeze = q.dim() == 3
        if squeeze:
            q, k, v = q[:, None], k[:, None], v[:, None]
        out = flash_attn_func(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), softmax_scale=scale,
                              causal=causal, deterministic=deterministic)
        out = (out[0] if isinstance(out, tuple) else out).transpose(1, 2)
        return out[:, 0] if squeeze else out

    return run


_compiled_naive: AttentionFn | None = None


def _naive_compiled(q, k, v, causal, scale, window=None):
    global _compiled_naive
    if _compiled_naive is None:
        _compiled_naive = torch.compile(_naive)
    return _compiled_naive(q, k, v, causal, scale, window)


_ENTRIES = [
    AttentionBackend("flash", _flash_auto, "FlashAttention-2: Triton on CUDA, tiled PyTorch elsewhere"),
    AttentionBackend("flash-triton", _flash_triton, "FlashAttention2Triton (CUDA; CPU only under TRITON_INTERPRET=1)",
                     runs_on="triton"),
    AttentionBackend("flash-torch", _flash_torch, "FlashAttention2Torch, the tiled pure-PyTorch op"),
    AttentionBackend("sdpa", _sdpa(None), "torch.nn.functional.scaled_dot_product_attention, kernel chosen by PyTorch"),
    AttentionBackend("naive", _naive, "materialised softmax(QK^T)V, the reference math"),
    AttentionBackend("naive-compiled", _naive_compiled, "the naive math under torch.compile", core=False),
    AttentionBackend("sdpa-flash", _sdpa("FLASH_ATTENTION"), "SDPA pinned to its FlashAttention-2 kernel",
                     runs_on="cuda", core=False),
    AttentionBackend("sdpa-cudnn", _sdpa("CUDNN_ATTENTION"), "SDPA pinned to its cuDNN kernel", runs_on="cuda",
                     core=False),
    AttentionBackend("sdpa-efficient", _sdpa("EFFICIENT_ATTENTION"), "SDPA pinned to its memory-efficient kernel",
                     runs_on="cuda", core=False),
    AttentionBackend("sdpa-math", _sdpa("MATH"), "SDPA pinned to its math (C++ reference) kernel", core=False),
    AttentionBackend("fa4", _fa4(False), "FlashAttention-4 (flash-attn-4, optional): the benchmarks' anchor",
                     runs_on="cuda", core=False, module="flash_attn.cute"),
    AttentionBackend("fa4-det", _fa4(True), "FlashAttention-4 with its deterministic backward (optional)",
                     runs_on="cuda", core=False, module="flash_attn.cute"),
]
ATTENTION_BACKENDS: dict[str, AttentionBackend] = {b.name: b for b in _ENTRIES}
CORE_BACKENDS: tuple[str, ...] = tuple(b.name for b in _ENTRIES if b.core)

# `flash_attention(backend=...)` and `FlashAttention(backend=...)` take the flash family's short names.
# The `backend` argument of the flash functions: "auto" (Triton on CUDA, the PyTorch op elsewhere), "triton", "torch".
Backend = Literal["auto", "triton", "torch"]
FLASH_ALIASES: dict[Backend, str] = {"auto": "flash", "triton": "flash-triton", "torch": "flash-torch"}
FLASH_SHORT_NAMES = {name: short for short, name in FLASH_ALIASES.items()}  # registry name -> short name


def get_backend(name: str) -> AttentionBackend:
    """The registered backend called `name` (a short flash name such as "triton" works too).

    Raises:
        ValueError: for an unknown name, listing the known ones.
    """
    entry = ATTENTION_BACKENDS.get(FLASH_ALIASES.get(name, name)) if isinstance(name, str) else None
    if entry is None:
        raise ValueError(f"unknown attention backend {name!r}; choose one of {list(ATTENTION_BACKENDS)}")
    return entry


def backend_report(device: torch.device | str | None = None) -> list[tuple[str, bool, str]]:
    """(name, works, note) for every backend on `device`: each core backend is run once on a tiny input;
    benchmark variants are only checked for availability (running `naive-compiled` would compile it)."""
    device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    q = torch.randn(1, 2, 16, 16, device=device)
    report = []
    for entry in ATTENTION_BACKENDS.values():
        why = entry.unavailable_reason(device)
        if why is not None:
            report.append((entry.name, False, why))
            continue
        try:
            if entry.core:
                entry(q, q, q, True, None)
            report.append((entry.name, True, entry.description))
        except Exception as e:  # report, don't crash
            report.append((entry.name, False, f"{type(e).__name__}: {str(e).splitlines()[0][:100]}"))
    return report
