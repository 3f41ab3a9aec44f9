"""flashsys' opaque torch.library ops are named by a digest of the attention package's source, so that a compiled
graph cached on disk by an older flashsys (whose ops' shapes may differ) is not found again."""

from __future__ import annotations

from pathlib import Path

import torch

from flashsys.ops.attention import flash_attention_decode, flash_attention_padded, library_ops, op_library
from flashsys.ops.attention.op_library import OVERLOAD, source_digest

OPAQUE_OPS = ("find_documents", "find_padding", "find_offsets", "packed_rows_forward", "packed_rows_backward",
              "flash_attention_decode", "flash_attention_forward_gluon", "flash_attention_forward_interpreted",
              "flash_attention_backward_gluon", "flash_attention_backward_interpreted")


def test_every_opaque_op_has_the_one_overload_named_by_the_source():
    for name in OPAQUE_OPS:
        assert getattr(torch.ops.flashsys, name).overloads() == [OVERLOAD], name
    assert library_ops.gluon_forward_op is getattr(torch.ops.flashsys.flash_attention_forward_gluon, OVERLOAD)
    assert OVERLOAD == source_digest(Path(op_library.__file__).parent)


def test_the_digest_changes_with_any_source_file_and_only_with_them(tmp_path):
    (tmp_path / "sub").mkdir()
    (tmp_path / "a.py").write_text("PLAN_HEADER = 2\n")
    (tmp_path / "sub" / "b.py").write_text("x = 1\n")
    (tmp_path / "notes.txt").write_text("not source")
    first = source_digest(tmp_path)
    assert first[0].isalpha() and first.isalnum()
    (tmp_path / "notes.txt").write_text("changed, still not source")
    assert source_digest(tmp_path) == first
    (tmp_path / "a.py").write_text("PLAN_HEADER = 3\n")  # a constant a fake kernel reads, in another module
    second = source_digest(tmp_path)
    assert second != first
    (tmp_path / "sub" / "b.py").rename(tmp_path / "sub" / "c.py")  # the same contents under another name
    assert source_digest(tmp_path) not in (first, second)


def test_a_compiled_graph_names_the_ops_with_the_digest():
    """What Inductor's on-disk cache keys a graph by is its code: the ops appear in it with the digest."""
    names = []

    def recording(gm, inputs):
        names.extend(str(n.target) for n in gm.graph.nodes if n.op == "call_function")
        return gm.forward

    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, 2, 6, 8, generator=g, dtype=torch.float64) for _ in range(3))
    mask = torch.tensor([[0, 1, 1, 1, 1, 1], [1, 1, 1, 1, 1, 1]], dtype=torch.bool)

    def step(q, k, v, mask):
        return flash_attention_padded(q, k, v, mask, causal=True), flash_attention_decode(
            q[:, :, -1:], k, v, key_mask=mask, causal=True)

    torch._dynamo.reset()
    torch.compile(step, backend=recording, fullgraph=True)(q, k, v, mask)
    ours = [n for n in names if n.startswith("flashsys.")]
    assert {"flashsys.find_padding", "flashsys.flash_attention_decode"} <= {n.rsplit(".", 1)[0] for n in ours}
    assert all(n.endswith("." + OVERLOAD) for n in ours), ours
