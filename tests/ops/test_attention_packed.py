"""flash_attention_packed: rows packing documents told apart by position ids, against float64 reference math per
document, eager and under torch.compile (where the call must stay in the graph)."""

from __future__ import annotations

import pytest
import torch
import torch.utils._python_dispatch

from flashsys.ops.attention import attention_reference, flash_attention_packed, get_backend, packed_rows
from flashsys.ops.attention.layout import empty_output

from .attention_checks import rel_err

CUDA = torch.cuda.is_available()
DEVICE = "cuda" if CUDA else "cpu"
# The Triton kernels run in the interpreter on a CPU (float32 there: it computes bf16 wrongly).
DTYPE = torch.bfloat16 if CUDA else torch.float32
TOLERANCE = 2e-2 if CUDA else 1e-5


def _heads_inside(b, h, n, d, g):
    """A (B, H, N, D) view of (B, N, H, D) memory: how a model's projection hands attention its heads."""
    return torch.randn(b, n, h, d, generator=g).to(DEVICE, DTYPE).transpose(1, 2)


def _inputs(batch, n, hq, hkv, d, seed=0):
    g = torch.Generator().manual_seed(seed)
    q, do = _heads_inside(batch, hq, n, d, g), _heads_inside(batch, hq, n, d, g)
    k, v = _heads_inside(batch, hkv, n, d, g), _heads_inside(batch, hkv, n, d, g)
    return q, k, v, do


def _reference(q, k, v, do, positions, causal, window):
    """O, dQ, dK, dV in float64, each document (a run of positions going on by one) attending only within itself."""
    outs = [torch.zeros(t.shape, dtype=torch.float64, device=t.device) for t in (q, q, k, v)]
    positions = positions.expand(q.shape[0], -1).tolist()
    for row, pos in enumerate(positions):
        starts = [0] + [i for i in range(1, len(pos)) if pos[i] != pos[i - 1] + 1] + [len(pos)]
        for a, b in zip(starts, starts[1:]):
            qs, ks, vs = (t[row:row + 1, :, a:b].double().requires_grad_() for t in (q, k, v))
            o, _ = attention_reference(qs, ks, vs, causal, None, window)
            grads = torch.autograd.grad(o, (qs, ks, vs), do[row:row + 1, :, a:b].double())
            for out, value in zip(outs, (o, *grads)):
                out[row:row + 1, :, a:b] = value
    return outs


POSITIONS = {
    "whole rows": lambda b, n: torch.arange(n)[None],
    "one packed row for the batch": lambda b, n: torch.cat([torch.arange(7), torch.arange(n - 12), torch.arange(5)])[None],
    "rows packed differently": lambda b, n: torch.stack([torch.arange(n), torch.cat([torch.arange(3), torch.arange(n - 3)])]),
}


@pytest.mark.parametrize("backend", ["torch", "triton"])
@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
@pytest.mark.parametrize("positions", list(POSITIONS))
@pytest.mark.parametrize("causal,window", [(True, None), (False, None), (True, (4, 0))])
def test_each_document_attends_only_within_itself(backend, compiled, positions, causal, window):
    if (why := get_backend(f"flash-{backend}").unavailable_reason(DEVICE)) is not None:
        pytest.skip(why)
    batch, n = 2, 24
    q, k, v, do = _inputs(batch, n, hq=4, hkv=2, d=16)
    position_ids = POSITIONS[positions](batch, n).to(DEVICE)

    def call(q, k, v, position_ids):
        return flash_attention_packed(q, k, v, position_ids, causal=causal, window_size=window, backend=backend)

    if compiled:
        torch._dynamo.reset()
        call = torch.compile(call, backend="aot_eager", fullgraph=True)  # fullgraph: no graph break allowed
    q, k, v = (t.detach().requires_grad_() for t in (q, k, v))
    o = call(q, k, v, position_ids)
    o.backward(do)
    expected = _reference(q.detach(), k.detach(), v.detach(), do, position_ids, causal, window)
    for name, got, ref in zip(("O", "dQ", "dK", "dV"), (o, q.grad, k.grad, v.grad), expected):
        assert got.shape == ref.shape and got.dtype == q.dtype
        assert rel_err(got, ref) < TOLERANCE, name


@pytest.mark.parametrize("positions", list(POSITIONS))
def test_the_compiled_ops_return_the_layout_their_fake_kernels_promise(positions):
    """A compiled graph trusts the fake kernels' strides: whole and packed rows alike must return them, for inputs
    with their heads inside (a model's projections) and for dense (B, H, N, D) ones."""
    batch, n = 2, 24
    q, k, v, do = _inputs(batch, n, hq=4, hkv=2, d=16)
    position_ids = POSITIONS[positions](batch, n).to(DEVICE)
    for inputs in ((q, k, v, do), tuple(t.contiguous() for t in (q, k, v, do))):
        q, k, v, do = inputs
        plan = torch.ops.flashsys.find_documents(position_ids, batch)
        for triton in (False, True) if get_backend("flash-triton").unavailable_reason(DEVICE) is None else (False,):
            o, lse = torch.ops.flashsys.packed_rows_forward(q, k, v, plan, -1, 0, 0.25, triton)
            assert o.stride() == empty_output(q).stride() and lse.shape == q.shape[:-1] and lse.is_contiguous()
            grads = torch.ops.flashsys.packed_rows_backward(q, k, v, o, lse, do, plan, -1, 0, 0.25, triton)
            for g, x in zip(grads, (q, k, v)):
                assert g.shape == x.shape and g.stride() == empty_output(x).stride()


@pytest.mark.parametrize("compiler", ["aot_eager", "inductor"])
def test_a_compiled_step_reads_the_positions_once(compiler, monkeypatch):
    """Every layer of a compiled model gets the same positions tensor: the documents are found once per step (a
    wait for the GPU each time), not once per layer or again in the backward (AOTAutograd merges the layers'
    identical `find_documents` calls)."""
    reads = []
    find = packed_rows._find_documents
    monkeypatch.setattr(packed_rows, "_find_documents", lambda p: reads.append(1) or find(p))
    q, k, v, do = _inputs(2, 24, hq=4, hkv=2, d=16)
    weights = torch.randn(3, 16, 16, device=DEVICE, dtype=DTYPE)

    def layers(q, k, v, position_ids):
        for w in weights:
            q = flash_attention_packed(q @ w, k, v, position_ids, causal=True, backend="torch")
        return q

    torch._dynamo.reset()
    step = torch.compile(layers, backend=compiler, fullgraph=True)
    for positions in ("one packed row for the batch", "whole rows", "rows packed differently"):
        reads.clear()
        position_ids = POSITIONS[positions](2, 24).to(DEVICE)
        x = q.detach().requires_grad_()
        out = step(x, k, v, position_ids)
        out.backward(do)
        assert len(reads) == 1
        expected = x.detach()
        for w in weights:
            expected = flash_attention_packed(expected @ w, k, v, position_ids, causal=True, backend="torch")
        torch.testing.assert_close(out, expected, rtol=1e-6, atol=1e-6)  # Inductor may fuse the matmuls' rounding


class _Reads(torch.utils._python_dispatch.TorchDispatchMode):
    """Counts reads of a tensor's value back to the host (each a wait for the device on a GPU)."""

    def __init__(self):
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.count += func is torch.ops.aten._local_scalar_dense.default
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("positions", list(POSITIONS))
def test_a_plan_is_used_without_reading_it_back(positions):
    """The kernels' ops learn a plan's documents from the note `find_documents` made, not by reading the plan (an
    alias of it too, as a backward gets a saved tensor); where the note is gone they read it, to the same result."""
    position_ids = POSITIONS[positions](2, 24).to(DEVICE)
    plan = torch.ops.flashsys.find_documents(position_ids, 2)
    expected = packed_rows.documents(position_ids, 2)
    with _Reads() as reads:
        noted = packed_rows.plan_documents(plan[:])
    assert reads.count == 0
    packed_rows._plan_notes.clear()
    read = packed_rows.plan_documents(plan)
    for found in (noted, read):
        assert (found is None) == (expected is None)
        if expected is not None:
            assert found.longest == expected.longest and found.cu_seqlens.tolist() == expected.cu_seqlens.tolist()


def test_documents_are_where_positions_do_not_go_on_by_one():
    positions = torch.tensor([[0, 1, 2, 0, 1, 5, 6], [3, 4, 5, 6, 7, 8, 9]])
    found = packed_rows.documents(positions, 2)
    assert found.cu_seqlens.tolist() == [0, 3, 5, 7, 14] and found.longest == 7
    assert packed_rows.documents(torch.arange(5, 12)[None], 3) is None  # offset positions are still whole rows


@pytest.mark.parametrize("bad,message", [
    (lambda n: torch.arange(n, dtype=torch.float32)[None], "integer tensor"),
    (lambda n: torch.arange(n + 1)[None], r"position_ids must be \(2, 8\) or \(1, 8\)"),
    (lambda n: torch.arange(n)[None].repeat(3, 1), r"position_ids must be \(2, 8\) or \(1, 8\)"),
    (lambda n: torch.arange(n), r"position_ids must be \(2, 8\) or \(1, 8\)"),
])
def test_bad_position_ids_are_refused_by_name(bad, message):
    q, k, v, _ = _inputs(2, 8, hq=2, hkv=2, d=16)
    with pytest.raises(ValueError, match=message):
        flash_attention_packed(q, k, v, bad(8).to(DEVICE))


def test_queries_and_keys_must_be_the_same_positions():
    q, _, _, _ = _inputs(2, 8, hq=2, hkv=2, d=16)
    _, k, v, _ = _inputs(2, 12, hq=2, hkv=2, d=16)
    with pytest.raises(ValueError, match="the same N"):
        flash_attention_packed(q, k, v, torch.arange(8, device=DEVICE)[None])
    with pytest.raises(ValueError, match="backend must be one of"):
        flash_attention_packed(q, q, q, torch.arange(8, device=DEVICE)[None], backend="cudnn")
