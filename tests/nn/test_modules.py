"""flashsys.nn: the drop-in module, RoPE, presets, backend parity inside the LM, training, checkpointing, bad input."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from flashsys.nn import ATTENTION_BACKENDS, PRESETS, FlashAttention, RotaryEmbedding, TransformerLM

CUDA = torch.cuda.is_available()
DEVICE = "cuda" if CUDA else "cpu"


def _qkv(b, h, n, d, device=DEVICE, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(b, h, n, d, generator=g).to(device, dtype).requires_grad_() for _ in range(3)]


@pytest.mark.parametrize("backend", ["auto", "torch", "triton"])
@pytest.mark.parametrize("causal", [False, True])
def test_flash_attention_module_matches_sdpa(backend, causal):
    q, k, v = _qkv(2, 3, 33 if not CUDA else 257, 16 if not CUDA else 64)
    out = FlashAttention(causal=causal, backend=backend)(q, k, v)
    ref = F.scaled_dot_product_attention(q, k, v, is_causal=causal)
    torch.testing.assert_close(out, ref, atol=2e-5, rtol=2e-5)
    g = torch.randn_like(out)
    grads = torch.autograd.grad(out, (q, k, v), g)
    ref_grads = torch.autograd.grad(ref, (q, k, v), g)
    for a, b in zip(grads, ref_grads):
        torch.testing.assert_close(a, b, atol=5e-5, rtol=5e-5)


def test_flash_attention_module_under_bf16_autocast_and_eval():
    q, k, v = _qkv(1, 2, 40, 32)
    module = FlashAttention(causal=True).eval()
    with torch.autocast(DEVICE, dtype=torch.bfloat16):
        out = module(q, k, v)
        ref = F.scaled_dot_product_attention(q.bfloat16(), k.bfloat16(), v.bfloat16(), is_causal=True)
    assert out.dtype == torch.bfloat16
    exact = F.scaled_dot_product_attention(q.double(), k.double(), v.double(), is_causal=True)
    err = (out.double() - exact).norm() / exact.norm()
    base = (ref.double() - exact).norm() / exact.norm()
    assert err <= 2 * base + 2e-3
    out.float().sum().backward()
    assert q.grad is not None and torch.isfinite(q.grad).all()


def test_flash_attention_module_inside_torch_compile():
    q, k, v = _qkv(1, 2, 24, 16)
    module = FlashAttention(causal=True)
    compiled = torch.compile(module)
    torch.testing.assert_close(compiled(q, k, v), module(q, k, v))


def test_rope_scores_depend_only_on_the_offset():
    rope = RotaryEmbedding(head_dim=16, context_length=64)
    q, k = torch.randn(16, dtype=torch.float64).float(), torch.randn(16).float()
    qs = rope(q.expand(64, 16).clone())
    ks = rope(k.expand(64, 16).clone())
    scores = qs @ ks.T  # scores[m, n] = <rope(q, m), rope(k, n)>
    for offset in (-5, 0, 3, 17):
        diag = torch.diagonal(scores, offset=offset)
        torch.testing.assert_close(diag, diag[0].expand_as(diag), atol=1e-4, rtol=1e-4)
    assert not torch.allclose(torch.diagonal(scores, 0)[0], torch.diagonal(scores, 5)[0])
    # Position 0 is the identity.
    torch.testing.assert_close(qs[0], q)


def test_rope_along_any_sequence_dim_is_the_same_rotation_laid_out_as_its_input():
    rope = RotaryEmbedding(head_dim=8, context_length=32)
    x = torch.randn(2, 20, 3, 8)  # (B, N, H, D)
    positions = torch.randint(0, 32, (20,))
    for pos in (None, positions):
        heads_first = rope(x.transpose(1, 2), pos).transpose(1, 2)
        out = rope(x, pos, seq_dim=1)
        assert torch.equal(out, heads_first) and out.is_contiguous()
        assert torch.equal(rope(x[0], pos, seq_dim=0), heads_first[0])
    for bad in (3, -1, -5):
        with pytest.raises(ValueError, match="seq_dim"):
            rope(x, seq_dim=bad)


@pytest.mark.parametrize("backend", ["flash-triton", "sdpa"])
def test_self_attention_copies_nothing_between_its_projections(backend):
    """q, k, v stay in the projection's (B, N, H, D) layout (RoPE rotates them there), the kernels write O and the
    gradients in it, so a forward and backward of the layer run no clone or contiguous copy."""
    import torch.utils._python_dispatch as dispatch

    from flashsys.nn import MultiHeadSelfAttention

    class Copies(dispatch.TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.count = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.count += func.overloadpacket in (torch.ops.aten.clone, torch.ops.aten.contiguous)
            return func(*args, **(kwargs or {}))

    if backend == "sdpa" and DEVICE == "cuda":
        pytest.skip("SDPA's CUDA kernels copy inside and hand back (B, H, N, D)-dense results (6 copies a layer where "
                    "a bare SDPA call on the same views makes 3): its cost, not the layer's")
    torch.manual_seed(0)
    layer = MultiHeadSelfAttention(64, 4, causal=True, rope_theta=10000.0, context_length=64,
                                   attention_backend=backend, num_kv_heads=2).to(DEVICE)
    x = torch.randn(2, 48, 64, device=DEVICE, requires_grad=True)
    layer(x).sum().backward()  # plans and choices made outside the count
    with Copies() as copies:
        layer(x).sum().backward()
    assert copies.count == 0


def test_preset_parameter_counts_on_meta():
    assert sum(p.numel() for p in TransformerLM.from_preset("small", device="meta").parameters()) == 128_625_408
    for name, p in PRESETS.items():
        model = TransformerLM.from_preset(name, vocab_size=10_000, device="meta")
        per_layer = 4 * p.d_model**2 + 3 * p.d_model * p.d_ff + 2 * p.d_model
        expected = 2 * 10_000 * p.d_model + p.num_layers * per_layer + p.d_model
        assert sum(x.numel() for x in model.parameters()) == expected, name
        assert all(x.device.type == "meta" for x in model.parameters())


def _tiny(backend="flash", **kw):
    torch.manual_seed(0)
    return TransformerLM(vocab_size=61, context_length=32, d_model=32, num_layers=2, num_heads=2, d_ff=64,
                         attention_backend=backend, **kw).to(DEVICE)


@pytest.mark.parametrize("backend", [b for b in ATTENTION_BACKENDS if b != "flash"])
def test_backends_give_the_same_logits_and_gradients(backend):
    model = _tiny("naive")
    ids = torch.randint(0, 61, (2, 20), device=DEVICE)
    ref_logits = model(ids)
    ref_grads = torch.autograd.grad(ref_logits.square().mean(), list(model.parameters()))
    model.set_attention_backend(backend)
    logits = model(ids)
    grads = torch.autograd.grad(logits.square().mean(), list(model.parameters()))
    torch.testing.assert_close(logits, ref_logits, atol=1e-5, rtol=1e-5)
    for a, b in zip(grads, ref_grads):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-4)


def test_a_few_training_steps_lower_the_loss():
    model = _tiny()
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    ids = torch.randint(0, 61, (4, 24), device=DEVICE)
    losses = []
    for _ in range(30):
        logits = model(ids[:, :-1])
        loss = F.cross_entropy(logits.reshape(-1, 61), ids[:, 1:].reshape(-1))
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert losses[-1] < 0.5 * losses[0], losses


def test_checkpointing_gives_the_same_gradients():
    ids = torch.randint(0, 61, (2, 16), device=DEVICE)
    grads = []
    for ckpt in (False, True):
        model = _tiny(checkpoint_blocks=ckpt)
        model(ids).float().logsumexp(-1).mean().backward()
        grads.append([p.grad for p in model.parameters()])
    for a, b in zip(*grads):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-5)


@pytest.mark.gpu
def test_lm_bf16_backend_parity_gpu():
    model = TransformerLM(1000, 256, 256, 2, 4, 512).cuda()
    ids = torch.randint(0, 1000, (2, 256), device="cuda")
    outs = {}
    for backend in ("sdpa", "flash-triton", "flash-torch"):
        model.set_attention_backend(backend)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            outs[backend] = model(ids).float()
    for backend in ("flash-triton", "flash-torch"):
        err = (outs[backend] - outs["sdpa"]).norm() / outs["sdpa"].norm()
        assert err < 2e-2, (backend, err.item())


BAD = [
    (lambda: TransformerLM(100, 16, 30, 1, 4, 64), "divisible"),
    (lambda: TransformerLM(100, 16, 12, 1, 4, 64), "even head_dim"),
    (lambda: TransformerLM.from_preset("huge"), "unknown preset"),
    (lambda: TransformerLM(100, 16, 32, 1, 2, 64, attention_backend="cudnn"), "unknown attention backend"),
    (lambda: FlashAttention(backend="cuda"), "backend"),
    (lambda: TransformerLM(0, 16, 32, 1, 2, 64), "vocab_size"),
]


@pytest.mark.parametrize("make,match", BAD, ids=[m for _, m in BAD])
def test_bad_configuration_is_a_clear_error(make, match):
    with pytest.raises(ValueError, match=match):
        make()


@pytest.mark.gpu
@pytest.mark.parametrize("backend", ["flash", "sdpa"])
def test_a_training_step_never_waits_for_the_gpu(backend):
    """No .item()-style read-back in forward or backward: the host runs ahead of the GPU (sync debug mode raises
    on any synchronising call). The first step, which autotunes the kernels, runs before the mode is set."""
    model = _tiny(backend)
    tokens = torch.randint(0, 61, (2, 32), device=DEVICE)
    for strict in (False, True):
        torch.cuda.set_sync_debug_mode("error" if strict else "default")
        try:
            with torch.autocast("cuda", dtype=torch.bfloat16):
                logits = model(tokens)
            F.cross_entropy(logits.float().flatten(0, 1), tokens.flatten()).backward()
        finally:
            torch.cuda.set_sync_debug_mode("default")


def test_bad_tokens_and_lengths_are_clear_errors():
    model = _tiny()
    with pytest.raises(ValueError, match="exceeds context_length 32"):
        model(torch.zeros(1, 33, dtype=torch.long, device=DEVICE))
    with pytest.raises(ValueError, match=r"\[0, 61\)"):
        model.check_token_ids(torch.full((1, 4), 61, dtype=torch.long, device=DEVICE))
    with pytest.raises(ValueError, match=r"\[0, 61\)"):
        model.cpu()(torch.full((1, 4), -1, dtype=torch.long))  # CPU inputs are checked on every call
    with pytest.raises(ValueError, match="set_attention_backend|unknown attention backend"):
        model.set_attention_backend("fast")


COMPILE_OPTIONS = [{}, {"fullgraph": True}, {"fullgraph": True, "dynamic": True},
                   {"fullgraph": True, "mode": "reduce-overhead"}]


@pytest.mark.gpu
@pytest.mark.parametrize("options", COMPILE_OPTIONS, ids=["default", "fullgraph", "dynamic", "reduce-overhead"])
def test_compiled_model_launches_the_flash_kernels_from_inductor(options):
    """torch.compile(model) with flash attention: no graph break (fullgraph), the Triton kernels appear in
    Inductor's generated code (launched from it, not from a Python callback), and logits and gradients match eager."""
    from torch._inductor.utils import run_and_get_code

    torch._dynamo.reset()
    model = _tiny("flash-triton")
    tokens = torch.randint(0, 61, (2, 32), device=DEVICE)

    def step(m):
        logits = m(tokens)
        F.cross_entropy(logits.flatten(0, 1), tokens.flatten()).backward()
        grads = [p.grad.clone() for p in model.parameters()]
        model.zero_grad(set_to_none=True)
        return logits.detach().clone(), grads

    expected = step(model)
    compiled = torch.compile(model, **options)
    _, code = run_and_get_code(lambda: step(compiled))  # the call that compiles
    source = "\n".join(code)
    for kernel in ("flash_fwd_kernel", "flash_bwd_dq_kernel", "flash_bwd_dkdv_kernel"):
        assert kernel in source, f"{kernel} is not launched from Inductor's code"
    for _ in range(2):  # reduce-overhead records its CUDA graph on a later call, then replays it
        got = step(compiled)
    torch.testing.assert_close(got[0], expected[0], atol=2e-4, rtol=2e-4)
    for a, b in zip(got[1], expected[1]):
        torch.testing.assert_close(a, b, atol=2e-4, rtol=2e-3)


def test_grouped_query_and_windowed_model_is_the_same_function_on_every_backend():
    """num_kv_heads and attention_window reach every backend: the same weights give the same logits."""
    model = _tiny("flash", num_kv_heads=1, attention_window=5)
    attn = model.layers[0].attn
    assert attn.qkv_proj.weight.shape == (32 + 2 * 16, 32)  # q: 2 heads of 16; k, v: one head each
    tokens = torch.randint(0, 61, (2, 32), device=DEVICE)
    expected = model(tokens)
    for backend in ("flash-torch", "sdpa", "naive"):
        model.set_attention_backend(backend)
        torch.testing.assert_close(model(tokens), expected, atol=2e-5, rtol=2e-5)
    model.set_attention_backend("flash")
    windowless = _tiny("flash", num_kv_heads=1)
    assert not torch.allclose(windowless(tokens), expected), "the window changed nothing"


def test_flash_attention_module_takes_sdpa_calls_and_refuses_what_it_cannot_do():
    q, k, v = (torch.randn(2, 4, 12, 16, device=DEVICE), torch.randn(2, 2, 12, 16, device=DEVICE),
               torch.randn(2, 2, 12, 16, device=DEVICE))
    module = FlashAttention()
    for is_causal in (False, True):
        torch.testing.assert_close(module(q, k, v, is_causal=is_causal, scale=0.3, enable_gqa=True),
                                   F.scaled_dot_product_attention(q, k, v, is_causal=is_causal, scale=0.3,
                                                                  enable_gqa=True), atol=2e-5, rtol=2e-5)
    with pytest.raises(ValueError, match="enable_gqa=True"):
        module(q, k, v)
    with pytest.raises(ValueError, match="attn_mask is not supported; express the mask as causal=True, a window"):
        module(q, k, v, attn_mask=torch.ones(12, 12, dtype=torch.bool, device=DEVICE), enable_gqa=True)
    with pytest.raises(ValueError, match="dropout_p=0.1 is not supported"):
        module(q, k, v, dropout_p=0.1, enable_gqa=True)
    with pytest.raises(ValueError, match="top-left by SDPA"):
        module(q[:, :, :5], k, v, is_causal=True, enable_gqa=True)
    windowed = FlashAttention(causal=True, window_size=(3, 0))
    torch.testing.assert_close(windowed(q, k, v, enable_gqa=True),
                               flash_attention_reference_output(q, k, v, (3, 0)), atol=2e-5, rtol=2e-5)
    with pytest.raises(ValueError, match="window_size"):
        FlashAttention(window_size=(-5, 0))


def flash_attention_reference_output(q, k, v, window):
    from flashsys.ops.attention import attention_reference

    return attention_reference(q, k, v, True, None, window)[0]


@pytest.mark.parametrize("backend", ["flash", "flash-torch"])
def test_packed_documents_give_each_segment_its_own_forward(backend):
    """Rows packed with documents: each segment's logits equal running that segment alone (attention within it,
    RoPE positions from its start)."""
    from flashsys.corpus import packed_offsets

    model = _tiny(backend, num_kv_heads=1)
    tokens = torch.randint(0, 61, (2, 32), device=DEVICE)
    docs = torch.tensor([[0] * 10 + [1] * 22, [3] * 32])
    offsets, longest = packed_offsets(docs)
    packed = model(tokens, offsets.to(DEVICE), longest)
    torch.testing.assert_close(packed[0, :10], model(tokens[:1, :10])[0], atol=2e-5, rtol=2e-5)
    torch.testing.assert_close(packed[0, 10:], model(tokens[:1, 10:])[0], atol=2e-5, rtol=2e-5)
    torch.testing.assert_close(packed[1], model(tokens[1:])[0], atol=2e-5, rtol=2e-5)
    with pytest.raises(ValueError, match="max_seqlen"):
        model(tokens, offsets.to(DEVICE))


def test_an_explicit_is_causal_wins_over_the_constructor_and_must_be_a_bool():
    """SDPA's call on a module built with causal=True: is_causal=False means not causal, is_causal=None (or left
    out) the module's default; a non-bool is refused like SDPA refuses it, not read as truthy."""
    q, k, v = _qkv(1, 2, 12, 16, seed=3)
    module = FlashAttention(causal=True)
    torch.testing.assert_close(module(q, k, v, is_causal=False), F.scaled_dot_product_attention(q, k, v),
                               atol=2e-5, rtol=2e-5)
    causal = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    torch.testing.assert_close(module(q, k, v), causal, atol=2e-5, rtol=2e-5)
    torch.testing.assert_close(FlashAttention()(q, k, v, is_causal=True), causal, atol=2e-5, rtol=2e-5)
    for bad in ("False", 2, 1.0):
        with pytest.raises(TypeError, match="is_causal must be True, False or None"):
            module(q, k, v, is_causal=bad)
    with pytest.raises(ValueError, match="FlashAttention: scale must be a positive"):
        module(q, k, v, scale=0)
    with pytest.raises(TypeError, match="FlashAttention: scale must be a float"):
        module(q, k, v, scale="0.1")


@pytest.mark.parametrize("offsets,match", [
    ([0, 40, 24, 64], "never decrease"),
    ([0, 16, 48], "end at the token count 64"),
    ([0, 16, 64], "max_seqlen"),
])
def test_packed_offsets_are_checked_before_the_model_uses_them(offsets, match):
    model = _tiny()
    tokens = torch.randint(0, 61, (2, 32), device=DEVICE)
    with pytest.raises(ValueError, match=match):
        model(tokens, torch.tensor(offsets, dtype=torch.int32, device=DEVICE), 40)


def test_token_ids_of_any_integer_dtype_are_taken():
    model = _tiny()
    tokens = torch.randint(0, 61, (2, 8), device=DEVICE)
    expected = model(tokens)
    for dtype in (torch.int8, torch.int16, torch.uint8, torch.int32):
        torch.testing.assert_close(model(tokens.to(dtype)), expected)
    for dtype in (torch.float32, torch.bool):
        with pytest.raises(TypeError, match="integer tensor"):
            model(tokens.to(dtype))
