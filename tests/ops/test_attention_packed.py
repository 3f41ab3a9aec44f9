"""flash_attention_packed and flash_attention_padded: rows packing documents told apart by position ids, and padded
rows, against float64 reference math per sequence, eager and under torch.compile (where the call must stay in the
graph)."""

from __future__ import annotations

import pytest
import torch
import torch.utils._python_dispatch

from flashsys.ops.attention import (
    attention_reference,
    flash_attention_packed,
    flash_attention_padded,
    get_backend,
    packed_rows,
)
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


def _reference(q, k, v, do, spans, causal, window):
    """O, dQ, dK, dV in float64, each (row, start, end) span attending only within itself; tokens in no span (pads)
    output 0 and get no gradient."""
    outs = [torch.zeros(t.shape, dtype=torch.float64, device=t.device) for t in (q, q, k, v)]
    for row, a, b in spans:
        if b == a:
            continue
        qs, ks, vs = (t[row:row + 1, :, a:b].double().requires_grad_() for t in (q, k, v))
        o, _ = attention_reference(qs, ks, vs, causal, None, window)
        grads = torch.autograd.grad(o, (qs, ks, vs), do[row:row + 1, :, a:b].double())
        for out, value in zip(outs, (o, *grads)):
            out[row:row + 1, :, a:b] = value
    return outs


def _documents(positions, batch):
    """(row, start, end) of each document: a run of positions going on by one."""
    spans = []
    for row, pos in enumerate(positions.expand(batch, -1).tolist()):
        starts = [0] + [i for i in range(1, len(pos)) if pos[i] != pos[i - 1] + 1] + [len(pos)]
        spans += [(row, a, b) for a, b in zip(starts, starts[1:])]
    return spans


def _real_runs(mask):
    """(row, start, end) of each row's one run of real tokens."""
    spans = []
    for row, real in enumerate(mask.tolist()):
        where = [i for i, r in enumerate(real) if r]
        spans.append((row, where[0], where[-1] + 1) if where else (row, 0, 0))
    return spans


ROWS = {  # name: (what says how the rows split, its (B, N) tensor for batch 2)
    "whole rows": ("positions", lambda n: torch.arange(n)[None]),
    "one packed row for the batch": ("positions",
                                     lambda n: torch.cat([torch.arange(7), torch.arange(n - 12), torch.arange(5)])[None]),
    "rows packed differently": ("positions",
                                lambda n: torch.stack([torch.arange(n), torch.cat([torch.arange(3), torch.arange(n - 3)])])),
    "offsets": ("offsets", lambda n: torch.tensor([0, 7, n, n + 3, 2 * n], dtype=torch.int32)),
    "offsets of whole rows": ("offsets", lambda n: torch.tensor([0, n, 2 * n])),
    "left padding": ("mask", lambda n: torch.stack([torch.arange(n) >= 5, torch.arange(n) >= 0])),
    "right padding": ("mask", lambda n: torch.stack([torch.arange(n) < n - 7, torch.arange(n) < 3]).long()),
    "a row all padding": ("mask", lambda n: torch.stack([torch.zeros(n, dtype=torch.bool), torch.arange(n) >= 2])),
    "a mask with no padding": ("mask", lambda n: torch.ones(2, n, dtype=torch.long)),
}


def _rows(name, n):
    kind, make = ROWS[name]
    return kind, make(n).to(DEVICE)


def _call(kind, rows, q, k, v, **options):
    if kind == "positions":
        return flash_attention_packed(q, k, v, rows, **options)
    if kind == "offsets":
        return flash_attention_packed(q, k, v, cu_seqlens_q=rows, **options)
    return flash_attention_padded(q, k, v, rows, **options)


def _spans(kind, rows, batch):
    if kind == "offsets":  # these examples' documents do not cross rows
        n = rows[-1].item() // batch
        return [(a // n, a % n, a % n + b - a) for a, b in zip(rows.tolist(), rows.tolist()[1:])]
    return _documents(rows, batch) if kind == "positions" else _real_runs(rows)


FINDERS = {"positions": "_find_documents", "offsets": "_find_offsets", "mask": "_find_padding"}


def _plan(kind, rows, batch):
    if kind == "positions":
        return torch.ops.flashsys.find_documents(rows, batch)
    if kind == "offsets":
        return torch.ops.flashsys.find_offsets(rows, rows, batch, rows[-1].item() // batch)
    return torch.ops.flashsys.find_padding(rows)


def _find(kind, rows, batch):
    if kind == "positions":
        return packed_rows._find_documents(rows.expand(batch, -1))
    if kind == "offsets":
        return packed_rows._find_offsets(rows, rows, batch, rows[-1].item() // batch)
    return packed_rows._find_padding(rows)


@pytest.mark.parametrize("backend", ["torch", "triton"])
@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
@pytest.mark.parametrize("rows", list(ROWS))
@pytest.mark.parametrize("causal,window", [(True, None), (False, None), (True, (4, 0))])
def test_each_sequence_attends_only_within_itself(backend, compiled, rows, causal, window):
    if (why := get_backend(f"flash-{backend}").unavailable_reason(DEVICE)) is not None:
        pytest.skip(why)
    batch, n = 2, 24
    q, k, v, do = _inputs(batch, n, hq=4, hkv=2, d=16)
    kind, split = _rows(rows, n)

    def call(q, k, v, split):
        return _call(kind, split, q, k, v, causal=causal, window_size=window, backend=backend)

    if compiled:
        torch._dynamo.reset()
        call = torch.compile(call, backend="aot_eager", fullgraph=True)  # fullgraph: no graph break allowed
    q, k, v = (t.detach().requires_grad_() for t in (q, k, v))
    o = call(q, k, v, split)
    o.backward(do)
    expected = _reference(q.detach(), k.detach(), v.detach(), do, _spans(kind, split, batch), causal, window)
    for name, got, ref in zip(("O", "dQ", "dK", "dV"), (o, q.grad, k.grad, v.grad), expected):
        assert got.shape == ref.shape and got.dtype == q.dtype
        assert rel_err(got, ref) < TOLERANCE, name
        if kind == "mask":  # pad tokens: exactly 0, not merely small
            assert not got.transpose(1, 2)[~split.bool()].any(), name


@pytest.mark.parametrize("rows", list(ROWS))
def test_the_compiled_ops_return_the_layout_their_fake_kernels_promise(rows):
    """A compiled graph trusts the fake kernels' strides: every kind of rows must return them, for inputs with
    their heads inside (a model's projections) and for dense (B, H, N, D) ones."""
    batch, n = 2, 24
    q, k, v, do = _inputs(batch, n, hq=4, hkv=2, d=16)
    kind, split = _rows(rows, n)
    plan = _plan(kind, split, batch)
    assert plan.shape == (packed_rows.plan_size(batch, n),)
    for inputs in ((q, k, v, do), tuple(t.contiguous() for t in (q, k, v, do))):
        q, k, v, do = inputs
        for triton in (False, True) if get_backend("flash-triton").unavailable_reason(DEVICE) is None else (False,):
            o, lse = torch.ops.flashsys.packed_rows_forward(q, k, v, plan, -1, 0, 0.25, triton)
            assert o.stride() == empty_output(q).stride() and lse.shape == q.shape[:-1] and lse.is_contiguous()
            grads = torch.ops.flashsys.packed_rows_backward(q, k, v, o, lse, do, plan, -1, 0, 0.25, triton)
            for g, x in zip(grads, (q, k, v)):
                assert g.shape == x.shape and g.stride() == empty_output(x).stride()


@pytest.mark.parametrize("compiler", ["aot_eager", "inductor"])
@pytest.mark.parametrize("kind", list(FINDERS))
def test_a_compiled_step_reads_the_rows_once(kind, compiler, monkeypatch):
    """Every layer of a compiled model gets the same positions or mask tensor: the sequences are found once per
    step (a wait for the GPU each time), not once per layer or again in the backward (AOTAutograd merges the layers'
    identical calls of the op that finds them)."""
    reads = []
    find = getattr(packed_rows, FINDERS[kind])
    monkeypatch.setattr(packed_rows, FINDERS[kind], lambda *args: reads.append(1) or find(*args))
    q, k, v, do = _inputs(2, 24, hq=4, hkv=2, d=16)
    weights = torch.randn(3, 16, 16, device=DEVICE, dtype=DTYPE)

    def layers(q, k, v, split):
        for w in weights:
            q = _call(kind, split, q @ w, k, v, causal=True, backend="torch")
        return q

    torch._dynamo.reset()
    step = torch.compile(layers, backend=compiler, fullgraph=True)
    for rows in (r for r in ROWS if ROWS[r][0] == kind):
        reads.clear()
        split = _rows(rows, 24)[1]
        x = q.detach().requires_grad_()
        out = step(x, k, v, split)
        out.backward(do)
        assert len(reads) == 1, rows
        expected = x.detach()
        for w in weights:
            expected = _call(kind, split, expected @ w, k, v, causal=True, backend="torch")
        torch.testing.assert_close(out, expected, rtol=1e-6, atol=1e-6)  # Inductor may fuse the matmuls' rounding


class _Counting(torch.utils._python_dispatch.TorchDispatchMode):
    """Counts the calls of one aten op: `_local_scalar_dense`, a read of a tensor's value back to the host, or
    `lift_fresh`, a Python value made into a tensor (on a GPU a copy in from the host); each waits for the device."""

    def __init__(self, op):
        super().__init__()
        self.op, self.count = op, 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.count += func is self.op
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("rows", list(ROWS))
def test_a_plan_is_used_without_reading_it_back(rows):
    """The kernels' ops learn a plan's sequences from the note the op that made it kept, not by reading the plan (an
    alias of it too, as a backward gets a saved tensor); where the note is gone they read it, to the same result."""
    kind, split = _rows(rows, 24)
    plan = _plan(kind, split, 2)
    expected = _find(kind, split, 2)
    with _Counting(torch.ops.aten._local_scalar_dense.default) as reads:
        noted = packed_rows.plan_sequences(plan[:])
    assert reads.count == 0
    packed_rows._plan_notes.clear()
    read = packed_rows.plan_sequences(plan)
    for found in (noted, read):
        assert (found is None) == (expected is None)
        if expected is not None:
            assert found.longest == expected.longest and found.cu_seqlens.tolist() == expected.cu_seqlens.tolist()
            assert (found.tokens is None) == (expected.tokens is None)
            assert found.tokens is None or found.tokens.tolist() == expected.tokens.tolist()


@pytest.mark.parametrize("rows", list(ROWS))
def test_making_a_plan_copies_nothing_in_from_the_host(rows):
    """A plan's one wait is its counts' reading: its header is filled on the device (an item assignment would copy
    each value in from the host and wait three more times)."""
    kind, split = _rows(rows, 24)
    with _Counting(torch.ops.aten.lift_fresh.default) as values:  # the ops' bodies: a mode does not see inside an op it dispatches
        if kind == "positions":
            packed_rows.document_plan(split, 2)
        elif kind == "offsets":
            packed_rows.offsets_plan(split, split, 2, split[-1].item() // 2)
        else:
            packed_rows.padding_plan(split)
    assert values.count == 0


def test_documents_are_where_positions_do_not_go_on_by_one():
    positions = torch.tensor([[0, 1, 2, 0, 1, 5, 6], [3, 4, 5, 6, 7, 8, 9]])
    found = packed_rows._find_documents(positions)
    assert found.cu_seqlens.tolist() == [0, 3, 5, 7, 14] and found.longest == 7 and found.tokens is None
    assert packed_rows._find_documents(torch.arange(5, 12)[None]) is None  # offset positions are still whole rows


def test_offsets_are_checked_when_read():
    q, k, v, _ = _inputs(2, 8, hq=2, hkv=2, d=16)
    cu = torch.tensor([0, 5, 16], dtype=torch.int32, device=DEVICE)
    with pytest.raises(ValueError, match="cu_seqlens_k differs from cu_seqlens_q"):
        flash_attention_packed(q, k, v, cu_seqlens_q=cu, cu_seqlens_k=torch.tensor([0, 6, 16], device=DEVICE))
    for bad in ([0, 5, 15], [1, 5, 16], [0, 9, 5, 16]):
        with pytest.raises(ValueError, match="cu_seqlens must start at 0, never decrease and end at the 16 tokens"):
            flash_attention_packed(q, k, v, cu_seqlens_q=torch.tensor(bad, device=DEVICE))
    with pytest.raises(ValueError, match="pass position_ids or the offsets"):
        flash_attention_packed(q, k, v, torch.arange(8, device=DEVICE)[None], cu_seqlens_q=cu)
    with pytest.raises(ValueError, match="cu_seqlens_q must be a 1-D integer tensor"):
        flash_attention_packed(q, k, v, cu_seqlens_q=cu.float())


def test_padding_finds_each_rows_real_tokens():
    mask = torch.tensor([[0, 0, 1, 1, 1], [1, 1, 0, 0, 0], [0, 0, 0, 0, 0]])
    found = packed_rows._find_padding(mask)
    assert found.cu_seqlens.tolist() == [0, 3, 5, 5] and found.longest == 3
    assert found.tokens.tolist() == [2, 3, 4, 5, 6]
    assert packed_rows._find_padding(torch.ones(2, 4, dtype=torch.bool)) is None


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
def test_padding_between_real_tokens_is_refused(compiled):
    q, k, v, _ = _inputs(2, 8, hq=2, hkv=2, d=16)
    mask = torch.tensor([[1, 1, 0, 1, 1, 1, 1, 1], [1] * 8], device=DEVICE)
    call = flash_attention_padded
    if compiled:
        torch._dynamo.reset()
        call = torch.compile(call, backend="aot_eager", fullgraph=True)
    with pytest.raises(ValueError, match="padding between real tokens"):
        call(q, k, v, mask, causal=True)


@pytest.mark.parametrize("bad,message", [
    (torch.ones(2, 8), "bool or integer tensor"),
    (torch.ones(2, 9, dtype=torch.bool), r"padding_mask must be \(2, 8\)"),
    (torch.ones(1, 8, dtype=torch.bool), r"padding_mask must be \(2, 8\)"),
])
def test_bad_padding_masks_are_refused_by_name(bad, message):
    q, k, v, _ = _inputs(2, 8, hq=2, hkv=2, d=16)
    with pytest.raises(ValueError, match=message):
        flash_attention_padded(q, k, v, bad.to(DEVICE))


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


def test_readings_of_tensors_that_died_are_dropped(monkeypatch):
    """An eager training loop passes a new positions tensor every step: the plans read from the ones that died (GPU
    tensors, up to 2 * B * N int32 each) must not pile up."""
    from flashsys.ops.attention import readback

    monkeypatch.setattr(readback, "cacheable", lambda t: True)
    monkeypatch.setattr(readback, "_known", {})
    q, k, v, _ = _inputs(2, 24, hq=2, hkv=2, d=16)
    for _ in range(100):
        flash_attention_packed(q, k, v, ROWS["one packed row for the batch"][1](24).to(DEVICE), backend="torch")
    assert len(readback._known) <= 32
