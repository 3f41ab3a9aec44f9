"""The attention backend registry: one name per implementation, all computing the same function."""

from __future__ import annotations

import pytest
import torch

from flashsys.ops.attention import ATTENTION_BACKENDS, CORE_BACKENDS, attention_reference, backend_report, get_backend

from .attention_checks import compile_without_cache_warnings, rel_err

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def test_short_flash_names_resolve_to_registry_entries():
    assert get_backend("auto").name == "flash"
    assert get_backend("triton").name == "flash-triton"
    assert get_backend("torch").name == "flash-torch"
    assert CORE_BACKENDS == ("flash", "flash-triton", "flash-torch", "sdpa", "naive")
    for bad in ("cudnn", "", None, 3):
        with pytest.raises(ValueError, match="unknown attention backend"):
            get_backend(bad)


def test_a_compiled_model_traces_the_triton_op_lookup_without_warnings(monkeypatch, recwarn):
    """A compiled model's flash call traces `triton_op` (the Triton Function, imported on first use) every time; a
    functools cache there made Dynamo warn on every compile. The first look-up may happen while tracing."""
    pytest.importorskip("triton")
    from flashsys.ops import attention
    from flashsys.ops.attention.flash_triton import FlashAttention2Triton

    def looks_up(x):
        attention.triton_op()
        return x + 1

    monkeypatch.setattr(attention, "_triton_ops", {})
    assert compile_without_cache_warnings(looks_up, torch.zeros(2), recwarn).tolist() == [1.0, 1.0]
    assert attention._triton_ops == {"FlashAttention2Triton": FlashAttention2Triton}


def test_the_compiled_graphs_opaque_ops_have_no_python_autograd_layer():
    """The opaque ops a compiled graph calls (the Gluon kernels on Hopper, the interpreter on a CPU) run inside the
    autograd.Function and are never differentiated, so they register no Autograd kernel: a torch.library.custom_op
    registers a Python one, which with its wrappers costs a compiled call host time on every op. Their fake kernels
    still give compile the shapes."""
    pytest.importorskip("triton")
    from flashsys.ops.attention import library_ops

    for op in (library_ops.gluon_forward_op, library_ops.interpreted_forward_op, library_ops.gluon_backward_op,
               library_ops.interpreted_backward_op):
        name = op.name()  # flashsys::flash_attention_<kind>.<overload>
        assert not torch._C._dispatch_has_kernel_for_dispatch_key(name, "Autograd"), name
        assert torch._C._dispatch_has_kernel_for_dispatch_key(name, "CompositeExplicitAutograd"), name
    q = torch.randn(1, 2, 40, 16, device="meta")
    o, lse = library_ops.interpreted_forward_op(q, q, q, -1, 0, 0.25)
    assert o.shape == q.shape and lse.shape == q.shape[:-1] and lse.dtype == torch.float32
    dq, dk, dv = library_ops.interpreted_backward_op(q, q, q, o, lse, q, -1, 0, 0.25)
    assert dq.shape == dk.shape == dv.shape == q.shape


@pytest.mark.parametrize("name", [n for n in ATTENTION_BACKENDS if n != "naive-compiled"])
def test_every_available_backend_matches_float64_reference(name):
    backend = ATTENTION_BACKENDS[name]
    if backend.unavailable_reason(DEVICE) is not None:
        pytest.skip(backend.unavailable_reason(DEVICE))
    # fp16 on a GPU, where SDPA's flash and cuDNN kernels take no fp32; fp32 on a CPU.
    dtype = torch.float16 if DEVICE == "cuda" else torch.float32
    g = torch.Generator().manual_seed(7)
    q, k, v = (torch.randn(2, 3, 37, 16, generator=g).to(DEVICE, dtype) for _ in range(3))
    ref = attention_reference(q.double(), k.double(), v.double(), True, 0.3)[0]
    out = backend(q, k, v, True, 0.3)
    assert out.shape == q.shape and out.dtype == q.dtype
    assert rel_err(out, ref) < (5e-3 if dtype == torch.float16 else 1e-5)


def test_unavailable_reason_without_cuda():
    if DEVICE == "cuda":
        pytest.skip("has CUDA")
    assert ATTENTION_BACKENDS["sdpa-cudnn"].unavailable_reason("cpu") == "needs CUDA"
    assert ATTENTION_BACKENDS["flash"].unavailable_reason("cpu") is None
    assert ATTENTION_BACKENDS["flash-triton"].unavailable_reason("cpu") is None  # conftest sets TRITON_INTERPRET=1


@pytest.mark.parametrize("triton, numpy, broken", [("3.6.0", "2.4.6", True), ("3.6.0+git1a2b", "2.4.0rc1", True),
                                                   ("3.6.0", "2.3.5", False), ("3.7.0", "2.4.6", False),
                                                   ("3.9.0", "2.5.0", False)])
def test_an_interpreter_that_cannot_run_the_kernels_is_named_before_a_call(monkeypatch, triton, numpy, broken):
    """Triton before 3.7 under NumPy 2.4 fails every interpreted kernel that loops over tiles with an error that
    names neither (triton-lang/triton#9171); the op, `flash_attention` and the registry say so up front."""
    pytest.importorskip("triton")
    import importlib.metadata

    from flashsys.ops.attention import flash_attention, flash_attention_packed, triton_env
    from flashsys.ops.attention.calls import check_device

    versions = {"triton": triton, "numpy": numpy}
    monkeypatch.setattr(importlib.metadata, "version", lambda package: versions[package])
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    triton_env.interpreter_problem.cache_clear()
    try:
        problem = triton_env.interpreter_problem()
        q = torch.randn(1, 2, 16, 16)
        if not broken:
            assert problem is None
            check_device(q, "op")
            return
        assert "triton>=3.7 or numpy<2.4" in problem and f"Triton {triton[:3]}" in problem
        assert ATTENTION_BACKENDS["flash-triton"].unavailable_reason("cpu") == problem
        assert ATTENTION_BACKENDS["flash"].unavailable_reason("cpu") is None  # the tiled PyTorch op on a CPU
        with pytest.raises(RuntimeError, match="triton-lang/triton#9171"):
            check_device(q, "op")
        with pytest.raises(RuntimeError, match="triton-lang/triton#9171"):
            flash_attention(q, q, q, causal=True, backend="triton")
        with pytest.raises(RuntimeError, match="backend='torch'"):
            flash_attention_packed(q, q, q, torch.tensor([[0, 1, 2, 0, 1, 2, 3, 4] * 2]), causal=True,
                                   backend="triton")
        assert ATTENTION_BACKENDS["flash"](q, q, q, True).shape == q.shape
    finally:
        triton_env.interpreter_problem.cache_clear()


def test_backend_report_lists_every_backend_once():
    report = backend_report()
    assert [name for name, _, _ in report] == list(ATTENTION_BACKENDS)
    works = {name: ok for name, ok, _ in report}
    assert works["flash"] and works["flash-torch"] and works["naive"]


def test_sdpa_backend_aligns_causal_masks_and_windows_bottom_right_and_groups_heads():
    """SDPA's own causal mask is top-left aligned; the registry entry passes flash-attn's mask instead."""
    g = torch.Generator().manual_seed(3)
    q, k, v = torch.randn(1, 4, 5, 8, generator=g), torch.randn(1, 2, 9, 8, generator=g), torch.randn(1, 2, 9, 8, generator=g)
    for causal, window in ((True, None), (False, (2, 1)), (True, (3, -1))):
        got = get_backend("sdpa")(q, k, v, causal, None, window)
        torch.testing.assert_close(got, get_backend("naive")(q, k, v, causal, None, window))


def test_launcher_arguments_are_checked_against_the_kernel_signature():
    from flashsys.ops.attention.triton import configs, launch

    kernel = configs.HANDLES["fwd"][64, False, False].fn
    q, k = torch.randn(1, 8, 16), torch.randn(2, 1, 8, 16).transpose(1, 2)[0]  # k: rank 3, non-contiguous
    named = dict(Q=q, K=k, V=q, O=q, L=q, CU_Q=q, CU_K=k, n_bh=3, n_heads=1, kv_group=1, n_q=8, n_k=8,
                 window_left=-1, window_right=0, qk_scale=1.0)
    args = launch.positional(kernel, named)
    assert args[:7] == (q, k, q, q, q, q, k) and args[-8:] == (3, 1, 1, 8, 8, -1, 0, 1.0)
    # Strides are derived from each tensor, in the kernel's (batch, head, seq, dim) order.
    assert args[7:15] == (*q.stride()[:1], 0, *q.stride()[1:], k.stride(0), 0, k.stride(1), k.stride(2))
    del named["K"]
    with pytest.raises(TypeError, match=r"missing \['K'\]"):
        launch.positional(kernel, named)
    with pytest.raises(TypeError, match="unexpected"):
        launch.positional(kernel, {**named, "K": k, "stride_xx": 3})
