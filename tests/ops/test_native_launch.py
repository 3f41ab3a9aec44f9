"""The native launcher (flashsys.ops.attention.replay.native): repeated eager calls run a C++ autograd node that
replays the Python path's plans. It must give the Python path's results bit for bit, keep the op's autograd contract
(saved tensors, double-backward refusal, in-place checks, hooks), hand back to Python whatever it has no plan for,
and pack kernel arguments exactly as the kernel's PTX declares them.

On a CPU the node runs the interpreter's launches (fp32); on a GPU it launches the compiled kernels (bf16).
test_eager_plans.py runs its replay tests with this launcher too.
"""

from __future__ import annotations

import json
import os
import struct
import subprocess
import sys
import time
import types
import warnings
from pathlib import Path

import pytest
import torch

from flashsys.ops.attention import FlashAttention2Triton, replay
from flashsys.ops.attention.replay import builder as native_build
from flashsys.ops.attention.replay import native as native_launch
from flashsys.ops.attention.replay import plans

from .attention_checks import assert_matches_reference, make_qkv, select_launcher

CUDA = torch.cuda.is_available()
DEVICE = "cuda" if CUDA else "cpu"
DTYPE = torch.bfloat16 if CUDA else torch.float32
NATIVE = "FlashAttention2TritonNativeBackward"


@pytest.fixture(autouse=True)
def native(request, monkeypatch):
    select_launcher("native", request, monkeypatch)
    replay.clear()
    yield
    replay.clear()


def _call(q, k, v, do, causal=True, scale=None, window=None):
    leaves = [t.detach().clone().requires_grad_() for t in (q, k, v)]
    o = FlashAttention2Triton.apply(*leaves, causal, scale, window)
    node = type(o.grad_fn).__name__
    lse = [t for t in o.grad_fn.saved_tensors if t.dtype == torch.float32 and t.dim() == q.dim() - 1]
    o.backward(do)
    return node, [o.detach(), *lse, *(t.grad for t in leaves)]


CASES = {
    "causal": dict(shape=(2, 2, 40, 40, 32), causal=True),
    "gqa, Nq != Nk, window": dict(shape=(1, 4, 24, 56, 16), causal=False, window=(8, 4), kv_heads=2),
    "rank 3, scale": dict(shape=(2, None, 33, 33, 16), causal=True, scale=0.3),
}


@pytest.mark.parametrize("case", CASES.values(), ids=CASES.keys())
def test_repeated_calls_run_the_native_node_and_equal_the_python_path(case):
    batch, heads, n_q, n_k, d = case["shape"]
    flags = dict(causal=case["causal"], scale=case.get("scale"), window=case.get("window"))
    q, k, v, do = make_qkv(batch, heads, n_q, n_k, d, DTYPE, DEVICE, seed=1, kv_heads=case.get("kv_heads"))
    # the Python path first (it may autotune on the first call, unless an earlier test chose this key's configs,
    # and makes the plans on the next), then the native node
    runs = [_call(q, k, v, do, **flags) for _ in range(4)]
    nodes = [node for node, _ in runs]
    assert nodes[0] == "_FlashAttention2TritonFunctionBackward" and nodes[-2:] == [NATIVE] * 2, nodes
    assert native_launch.sizes() == (1, 1, 0)
    for node, results in runs[nodes.index(NATIVE):]:
        assert len(results) == len(runs[0][1]) == 5  # O, exactly one float32 logsumexp, three gradients
        for native_result, python_result in zip(results, runs[0][1]):
            assert torch.equal(native_result, python_result)
    q2, k2, v2, do2 = make_qkv(batch, heads, n_q, n_k, d, DTYPE, DEVICE, seed=2, kv_heads=case.get("kv_heads"))
    assert_matches_reference(FlashAttention2Triton, q2, k2, v2, do2, case["causal"], case.get("scale"),
                             case.get("window"))


def _warm(q, k, v, do):
    for _ in range(2):
        _call(q, k, v, do)
    assert native_launch.sizes() == (1, 1, 0)


def test_forgetting_the_plans_forgets_the_native_copies():
    """replay.clear() (a test forcing another kernel variant, a change of the determinism switch) must empty
    the native tables too: a native plan left behind would replay the old kernels in eager calls only."""
    q, k, v, do = make_qkv(1, 2, 24, 24, 16, DTYPE, DEVICE, seed=4)
    _warm(q, k, v, do)
    replay.clear()
    assert native_launch.sizes() == (0, 0, 0)
    assert _call(q, k, v, do)[0] != NATIVE  # the next call takes the Python path again


def test_a_compiled_graphs_ops_replay_natively_with_the_python_replays_bits():
    """The opaque ops' bodies (what a compiled graph calls for the Gluon kernels) offer their plans to the native side,
    whose replays give the Python replays' bits, for a stride-0 dO too; a suspended launcher and a signature without
    a plan return None (the Python body then runs)."""
    from flashsys.ops.attention import library_ops

    window, scale = (8, 4), 0.25
    q, k, v, do = (t.detach() for t in make_qkv(1, 4, 24, 56, 16, DTYPE, DEVICE, seed=5, kv_heads=2))
    for _ in range(2):  # the full path (it may autotune first), which makes the plan and offers it
        o, lse = library_ops.opaque_forward(q, k, v, *window, scale)
    assert native_launch.sizes() == (0, 0, 1)
    native_o, native_lse = native_launch.op_forward(window, scale, q, k, v)
    python_o, python_lse = plans.op_forward_plans.values()[0].launch(q, k, v)
    assert torch.equal(native_o, python_o) and torch.equal(native_lse, python_lse) and torch.equal(native_o, o)
    stride0_do = do[..., :1].expand_as(do)  # as `o.sum().backward()` hands it over
    for _ in range(2):
        grads = library_ops.opaque_backward(q, k, v, o, lse, stride0_do, *window, scale)
    assert native_launch.sizes() == (0, 1, 1)
    native_grads = native_launch.op_backward(window, scale, q, k, v, o, lse, stride0_do)
    assert len(native_grads) == 3 and all(torch.equal(a, b) for a, b in zip(native_grads, grads))
    with native_launch.suspended():
        assert native_launch.op_forward(window, scale, q, k, v) is None
        assert native_launch.op_backward(window, scale, q, k, v, o, lse, stride0_do) is None
    assert native_launch.op_forward((8, 5), scale, q, k, v) is None  # another window: no plan
    assert native_launch.op_forward(window, scale, q[:, :, 1:], k, v) is None  # another shape: no plan


def test_the_native_node_keeps_the_autograd_contract():
    q, k, v, do = make_qkv(1, 2, 24, 24, 16, DTYPE, DEVICE, seed=3)
    _warm(q, k, v, do)
    leaves = [t.detach().clone().requires_grad_() for t in (q, k, v)]

    o = FlashAttention2Triton.apply(*leaves, True)
    assert type(o.grad_fn).__name__ == NATIVE and o.grad_fn.next_functions
    with pytest.raises(RuntimeError, match="double backward is not supported"):
        torch.autograd.grad(o.sum(), leaves[0], create_graph=True)

    o = FlashAttention2Triton.apply(*leaves, True)
    with torch.no_grad():
        leaves[2].mul_(1.0)  # a saved input changed after the forward
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        o.backward(do)

    leaves = [t.detach().clone().requires_grad_() for t in (q, k, v)]
    o = FlashAttention2Triton.apply(*leaves, True)
    seen = []
    o.register_hook(lambda g: seen.append(g.shape))
    o.backward(do)
    assert seen == [o.shape]
    with pytest.raises(RuntimeError, match="freed|second time"):
        o.grad_fn.saved_tensors  # noqa: B018 - freed by the backward, as a Python Function's

    with torch.no_grad():
        o = FlashAttention2Triton.apply(q, k, v, True)
    assert o.grad_fn is None
    assert torch.equal(o, _call(q, k, v, do)[1][0])


def test_what_the_native_side_does_not_take_goes_back_to_python():
    q, k, v, do = make_qkv(1, 2, 24, 24, 16, DTYPE, DEVICE, seed=4)
    _warm(q, k, v, do)
    assert native_launch.forward(q, k, v, True, None, None) is not None
    assert native_launch.forward(q, k, v, 1, None, None) is None  # flags of another type: the full path decides
    assert native_launch.forward(q, k, v, True, None, (4, 0)) is None  # no plan for these flags yet
    assert native_launch.forward(q, k, v, True, None, (2**70, 0)) is None  # beyond C++'s int64: Python validates
    assert native_launch.forward(q.transpose(-1, -2).contiguous().transpose(-1, -2), k, v, True, None, None) is None
    import torch.autograd.forward_ad as fwad

    with fwad.dual_level():
        dual = fwad.make_dual(q, torch.randn_like(q))
        assert native_launch.forward(dual, k, v, True, None, None) is None  # forward-mode AD: Python's Function
    # a backward with a dO of other strides has no native backward plan: the Python path computes it and offers one
    leaves = [t.detach().clone().requires_grad_() for t in (q, k, v)]
    o = FlashAttention2Triton.apply(*leaves, True)
    o.backward(do.transpose(1, 2).contiguous().transpose(1, 2))
    assert native_launch.sizes() == (1, 2, 0)
    torch.testing.assert_close(leaves[0].grad, _call(q, k, v, do)[1][2], rtol=0, atol=0)


def _fake_kernel(signature: dict, ptx_params: list[str], **metadata):
    md = dict(num_warps=4, num_ctas=1, shared=1024, global_scratch_size=0, profile_scratch_size=0, launch_pdl=False,
              launch_cooperative_grid=False, tensordesc_meta=None)
    md.update(metadata)
    ptx = ".visible .entry k(\n" + ",\n".join(f"\t.param .{p} k_param_{i}" for i, p in enumerate(ptx_params)) + "\n)"
    return types.SimpleNamespace(metadata=types.SimpleNamespace(**md), src=types.SimpleNamespace(signature=signature),
                                 asm={"ptx": ptx}, function=0xABC)


def test_arguments_are_packed_as_the_ptx_declares_them():
    signature = {"A": "*bf16", "B": "*fp32", "s": "i32", "one": "constexpr", "big": "i64", "scale": "fp32",
                 "BLOCK": "constexpr"}
    kernel = _fake_kernel(signature, ["u64", "u64", "u32", "u64", "f32", "u64", "u64"])
    replay = plans.Replay(None, (3, 0), (-5, 1, 2**40 + 7, 0.125, 64), kernel, (4, 2, 1))
    fn, grid, threads, shared, words, pointers, keep_alive, maps = native_launch.cuda_launch_spec(replay)
    assert keep_alive is kernel and maps == []
    assert (fn, grid, threads, shared) == (0xABC, (4, 2, 1), 128, 1024)
    assert pointers == [(0, 3), (1, 0)]
    assert words == [0, 0, 2**32 - 5, 2**40 + 7, struct.unpack("<I", struct.pack("<f", 0.125))[0], 0, 0]
    refused = {
        "a scratch buffer": _fake_kernel(signature, ["u64"] * 2 + ["u32", "u64", "f32"] + ["u64"] * 2,
                                         global_scratch_size=64),
        "PTX of another signature": _fake_kernel(signature, ["u64", "u64", "u64", "u64", "f32"]),
        "a cluster": _fake_kernel(signature, ["u64"] * 2 + ["u32", "u64", "f32"], num_ctas=2),
    }
    for why, bad in refused.items():
        assert native_launch.cuda_launch_spec(replay._replace(kernel=bad)) is None, why
    bad = replay._replace(kernel=refused["a cluster"])
    with pytest.warns(RuntimeWarning, match="cannot launch"):  # a refused plan stays Python's, and says so once
        assert native_launch.launch_specs((bad,)) is None
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert native_launch.launch_specs((bad,)) is None


def test_a_plan_the_extension_refuses_keeps_the_python_path_and_says_so(monkeypatch):
    """Where the extension refuses a plan's launches (a driver without `cuTensorMapEncodeTiled`, say), the call that
    offered it runs on: the plan stays with the Python path, with one warning, and is not offered again."""
    monkeypatch.setattr(native_launch, "_warned", set())
    offers = []

    def refuse(specs):
        offers.append(specs)
        raise ValueError("flashsys native launch: this driver has no cuTensorMapEncodeTiled")

    plan = plans.ForwardPlan((-1, 0), 0.125, (1, 4), ())
    with pytest.warns(RuntimeWarning, match="refused a plan .*cuTensorMapEncodeTiled.*Python path"):
        native_launch._offer(plan, refuse)
    assert plan.native is False and offers == [[]]
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        native_launch._offer(plan, refuse)
        native_launch._offer(plans.ForwardPlan((-1, 0), 0.125, (1, 4), ()), refuse)  # another plan: not said again
    assert len(offers) == 2


def test_tensor_map_parameters_are_read_from_the_ptx():
    """A TMA descriptor parameter (`.param .align 64 .b8 name[128]`) is one parameter of its own kind; a declaration
    of any other shape makes the kernel's parameters unreadable (None), so its launch stays with Triton's."""
    entry = ".visible .entry k(\n\t.param .align 64 .b8 k_param_0[128],\n\t.param .u32 k_param_1,\n" \
            "\t.param .u64 .ptr .global .align 1 k_param_2,\n\t.param .f32 k_param_3\n)"
    assert native_launch.ptx_parameters(entry) == (native_launch.TENSOR_MAP, "u32", "u64", "f32")
    assert native_launch.ptx_parameters(entry.replace("[128]", "[64]")) is None
    assert native_launch.ptx_parameters(entry.replace(".align 64 .b8", ".align 16 .b8")) is None


@pytest.mark.skipif(CUDA, reason="packs kernels compiled for sm_90 under a stand-in driver; a GPU runs the launches")
def test_gluon_launches_are_packed_as_tritons_launcher_passes_them():
    """Every Gluon kind's first variant at D 64 and 128 (compiled for sm_90 on this machine, in a subprocess: it
    installs a stand-in driver), replayed from a plan, packs into one cuLaunchKernel launch: a word per PTX parameter,
    each TMA descriptor a tensor map encoded from its call tensor with the arguments Triton's launcher would give
    cuTensorMapEncodeTiled, its shape and strides after it as that launcher passes them."""
    pytest.importorskip("triton.experimental.gluon.language.nvidia.hopper")
    from flashsys.ops.attention import gluon

    if gluon.kernels() is None:
        pytest.skip("this Triton has no Gluon Hopper API")
    env = {key: value for key, value in os.environ.items() if key != "TRITON_INTERPRET"}
    root = Path(__file__).resolve().parents[2]
    r = subprocess.run([sys.executable, "-m", "tests.ops.kernel_compile", "--native-packing"], capture_output=True,
                       text=True, timeout=900, env=env, cwd=root)
    assert r.returncode == 0, r.stderr[-3000:]
    verdicts = json.loads(r.stdout.strip().splitlines()[-1])
    assert any("one_pass_det" in label for label in verdicts) and any("dkdv" in label for label in verdicts)
    assert all(why == "ok" for why in verdicts.values()), verdicts


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA or torch.cuda.get_device_capability() != (9, 0), reason="the Gluon kernels need sm_90")
@pytest.mark.parametrize("case", ["D 64 causal one pass", "D 128 gqa full two passes", "D 64 rank 3 window"])
def test_gluon_plans_launch_natively_and_equal_the_python_path_gpu(case, monkeypatch):
    """Repeated eager calls that the Gluon kernels take run the native node with every launch native: the TMA
    descriptors encoded in C++ on each call's tensors (no Python launch, no GIL), with the Python path's bits, and
    the float64 reference's results on fresh inputs (new addresses in every descriptor)."""
    from flashsys.ops.attention import dispatch
    from flashsys.ops.attention.gluon import launch as gluon_launch

    from .attention_checks import refuse_calls

    d = 64 if case.startswith("D 64") else 128
    monkeypatch.setattr(dispatch, "MIN_WORK", 0)
    if "one pass" in case:
        monkeypatch.setitem(dispatch.DETERMINISTIC_ONE_PASS_VARIANTS, d,
                            tuple(v for v in dispatch.DETERMINISTIC_ONE_PASS_VARIANTS[d] if v.kind != "tl")[:1])
    else:
        monkeypatch.setitem(dispatch.DETERMINISTIC_ONE_PASS_VARIANTS, d, (gluon_launch.TL_KERNEL,))
        monkeypatch.setitem(dispatch.DQ_VARIANTS, d, dispatch.DQ_VARIANTS[d][1:2])
    dispatch.forget_choices()
    replay.clear()
    packed = []
    pack = native_launch.launch_specs
    monkeypatch.setattr(native_launch, "launch_specs", lambda replays: packed.append(pack(replays)) or packed[-1])
    shape, causal, window, kv_heads = {
        "D 64 causal one pass": ((2, 4, 700, 700), True, None, None),
        "D 128 gqa full two passes": ((1, 8, 600, 520), False, None, 2),
        "D 64 rank 3 window": ((3, None, 640, 640), False, (96, 32), None),
    }[case]
    try:
        q, k, v, do = make_qkv(*shape, d, torch.bfloat16, "cuda", seed=1, kv_heads=kv_heads)
        first = _call(q, k, v, do, causal, None, window)  # the full path: variants chosen (and autotuned)
        assert first[0] != NATIVE
        _call(q, k, v, do, causal, None, window)  # by now the plans are made and offered to the native side
        assert native_launch.sizes() == (1, 1, 0)
        chosen = {key.kernel: var.kind for key, var in dispatch.chosen_variants().items()}
        assert chosen["forward"] != "tl" and ("one pass" not in case or chosen["one_pass_det"] == "one_pass_det")
        assert packed and None not in packed, "the native side refused a plan"
        specs = [spec for plan_specs in packed for spec in plan_specs]
        assert all(len(spec) == 8 for spec in specs), "a launch stayed with Python"
        assert sum(len(spec[7]) for spec in specs) >= 4, "no Gluon launch was packed with its tensor maps"
        refuse_calls(monkeypatch, gluon_launch.GluonReplay, "__call__")
        for _ in range(2):
            node, results = _call(q, k, v, do, causal, None, window)
            assert node == NATIVE
            for native_result, python_result in zip(results, first[1]):
                assert torch.equal(native_result, python_result)
        q2, k2, v2, do2 = make_qkv(*shape, d, torch.bfloat16, "cuda", seed=2, kv_heads=kv_heads)
        assert_matches_reference(FlashAttention2Triton, q2, k2, v2, do2, causal, None, window)
    finally:
        replay.clear()
        dispatch.forget_choices()


def _as_a_new_process(monkeypatch):
    """The launcher's state as a process starts: nothing built or loaded yet (restored after the test)."""
    monkeypatch.setattr(native_launch, "_module", None)
    monkeypatch.setattr(native_launch, "_thread", None)
    monkeypatch.setattr(native_launch, "_status", "not built")


def test_a_failed_build_says_why_and_leaves_the_python_path(monkeypatch, tmp_path):
    broken = tmp_path / "broken.cpp"
    broken.write_text("this is not C++\n")
    monkeypatch.setattr(native_launch, "SOURCE", broken)
    monkeypatch.setattr(native_launch, "EXTENSION_NAME", "flashsys_native_launch_broken_test")
    _as_a_new_process(monkeypatch)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert not native_launch.wait()
    assert native_launch.status().startswith("failed:") and "error" in native_launch.status()
    assert any("did not build" in str(w.message) for w in caught)
    q, k, v, do = make_qkv(1, 2, 24, 24, 16, DTYPE, DEVICE, seed=5)
    assert_matches_reference(FlashAttention2Triton, q, k, v, do, True, None)


def test_a_build_killed_midway_blocks_no_later_process(monkeypatch):
    """torch's build lock is a file, which a process killed mid-build (a script stopped in its first minute) left
    behind: every later process's build would wait on it forever and the launcher never come up (`wait()` hangs). Such a kill leaves a lock file and no completion mark; the next process must build
    past them, and the one after that import the build directly, with no builder run."""
    directory = native_launch.build_directory()
    assert native_build.completed(directory, native_launch.EXTENSION_NAME)  # the fixture's wait() built or imported it there
    (directory / native_build.BUILT).unlink()
    (directory / "lock").touch()
    _as_a_new_process(monkeypatch)
    assert native_launch.wait(timeout=300), native_launch.status()
    assert not (directory / "lock").exists() and native_build.completed(directory, native_launch.EXTENSION_NAME)

    def build_again(directory):
        raise AssertionError(f"a completed build in {directory} was built again")

    monkeypatch.setattr(native_launch, "_build_elsewhere", build_again)
    _as_a_new_process(monkeypatch)
    assert native_launch.wait(timeout=60) and native_launch.status() == "ready", native_launch.status()


def test_the_build_outlives_the_process_that_started_it(monkeypatch, tmp_path):
    """A process that exits while the build runs (a short script) still leaves a completed build for the next one:
    the builder runs in a session of its own. Builds from scratch in an empty extensions root."""
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    # The script exits as soon as the builder holds its lock: while the build has only just begun.
    script = "\n".join(["import pathlib, sys, time", "from flashsys.ops.attention.replay import native as native_launch",
                        "native_launch.start_build()",
                        "while not list(pathlib.Path(sys.argv[1]).glob('*/flashsys.lock')): time.sleep(0.01)"])
    subprocess.run([sys.executable, "-c", script, str(tmp_path)], check=True, timeout=300)
    directory = native_launch.build_directory()
    assert directory.parent == tmp_path and not native_build.completed(directory, native_launch.EXTENSION_NAME)
    deadline = time.monotonic() + 300  # a build takes 25-40 s
    while not native_build.completed(directory, native_launch.EXTENSION_NAME) and time.monotonic() < deadline:
        time.sleep(1)
    assert native_build.completed(directory, native_launch.EXTENSION_NAME), sorted(p.name for p in directory.iterdir())


def test_the_build_directory_names_what_the_library_depends_on(monkeypatch, tmp_path):
    """A build is reused only by the same source, flags and versions: each names a directory of its own, under the
    root torch's own builds use."""
    from torch.utils.cpp_extension import get_default_build_root

    monkeypatch.delenv("TORCH_EXTENSIONS_DIR", raising=False)
    assert native_launch.build_directory().parent == Path(get_default_build_root())
    seen = {native_launch.build_directory()}
    edited = tmp_path / "native_launch.cpp"
    edited.write_bytes(native_launch.SOURCE.read_bytes() + b"// edited\n")
    monkeypatch.setattr(native_launch, "SOURCE", edited)
    seen.add(native_launch.build_directory())
    monkeypatch.setattr(torch, "__version__", "0.0.0")
    seen.add(native_launch.build_directory())
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    seen.add(native_launch.build_directory())
    assert len(seen) == 4 and native_launch.build_directory().parent == tmp_path


def test_the_switch_takes_only_on_or_off(monkeypatch):
    monkeypatch.setenv(native_launch.ENV, "off")
    assert native_launch.status() == "off (FLASHSYS_NATIVE_LAUNCH=off)"
    monkeypatch.setenv(native_launch.ENV, "1")
    assert native_launch.status() == "ready"
    monkeypatch.setenv(native_launch.ENV, "maybe")
    with pytest.raises(ValueError, match="FLASHSYS_NATIVE_LAUNCH='maybe'"):
        native_launch.start_build()
