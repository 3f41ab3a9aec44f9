"""flashsys as a transformers attention implementation, against the `sdpa` implementation on the same weights:
tiny models built from configs (no downloads), in float64 so any difference is a difference in what is computed."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.utils._python_dispatch

transformers = pytest.importorskip("transformers")

from flashsys.integrations.transformers import NAME, attention_forward, register  # noqa: E402

SMALL = dict(vocab_size=97, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
             max_position_embeddings=128)
FAMILIES = {
    "llama-gqa": ("LlamaConfig", "LlamaForCausalLM", dict(num_key_value_heads=2)),
    "mistral-window": ("MistralConfig", "MistralForCausalLM", dict(num_key_value_heads=1, sliding_window=6)),
    "qwen2-mixed": ("Qwen2Config", "Qwen2ForCausalLM", dict(num_key_value_heads=2, use_sliding_window=True,
                                                            sliding_window=5,
                                                            layer_types=["sliding_attention", "full_attention"])),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", dict(num_key_value_heads=2, head_dim=24)),
}


def _pair(family: str, **changes):
    """(sdpa model, flashsys model) with the same float64 weights, in eval mode."""
    config_name, model_name, extra = FAMILIES[family]
    config = getattr(transformers, config_name)(**{**SMALL, **extra, **changes})
    model_cls = getattr(transformers, model_name)
    torch.manual_seed(0)
    # from_config writes the implementation into the config it is given: each model gets its own copy.
    ref = model_cls._from_config(copy.deepcopy(config), attn_implementation="sdpa").double().eval()
    ours = model_cls._from_config(copy.deepcopy(config), attn_implementation=register()).double().eval()
    ours.load_state_dict(ref.state_dict())
    assert ours.config._attn_implementation == NAME
    return ref, ours


def _tokens(batch: int, n: int, seed: int = 1) -> torch.Tensor:
    """Random ids, never 0: generate() takes 0 (the pad id below) in its input for padding."""
    return torch.randint(1, SMALL["vocab_size"], (batch, n), generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("family", list(FAMILIES))
def test_logits_and_every_gradient_match_sdpa(family):
    ref, ours = _pair(family)
    x = _tokens(2, 20)
    outs = []
    for model in (ref, ours):
        model.zero_grad()
        out = model(x, labels=x, use_cache=False)
        out.loss.backward()
        outs.append((out.logits, {n: p.grad for n, p in model.named_parameters()}))
    torch.testing.assert_close(outs[1][0], outs[0][0], rtol=1e-10, atol=1e-10)
    for name, grad in outs[0][1].items():
        torch.testing.assert_close(outs[1][1][name], grad, rtol=1e-9, atol=1e-10, msg=name)


def test_the_window_is_applied_where_the_layer_has_one():
    """The windowed model's logits differ from the same weights without a window (the check above is not vacuous)."""
    ref, ours = _pair("mistral-window")
    x = _tokens(1, 20)
    unwindowed = copy.deepcopy(ours)
    for layer in unwindowed.model.layers:
        layer.self_attn.sliding_window = None
    unwindowed.config.sliding_window = None
    assert (ours(x).logits - unwindowed(x).logits).abs().max() > 1e-3


@pytest.mark.parametrize("family", ["llama-gqa", "qwen2-mixed"])
def test_packed_rows_match_each_document_run_alone(family):
    ref, ours = _pair(family)
    lengths = [7, 9, 4]
    x = _tokens(1, sum(lengths))
    positions = torch.cat([torch.arange(n) for n in lengths])[None]
    packed = ours(x, position_ids=positions, use_cache=False).logits
    torch.testing.assert_close(packed, ref(x, position_ids=positions, use_cache=False).logits, rtol=1e-10, atol=1e-10)
    start = 0
    for n in lengths:
        alone = ours(x[:, start : start + n], use_cache=False).logits
        torch.testing.assert_close(packed[:, start : start + n], alone, rtol=1e-10, atol=1e-10)
        start += n
    # The collator's offsets (DataCollatorWithFlattening) give the same result.
    cu = torch.tensor([0, 7, 16, 20], dtype=torch.int32)
    collated = ours(x, position_ids=positions, cu_seq_lens_q=cu, cu_seq_lens_k=cu, max_length_q=9, max_length_k=9,
                    use_cache=False).logits
    torch.testing.assert_close(collated, packed, rtol=1e-12, atol=1e-12)


class _DeviceReads(torch.utils._python_dispatch.TorchDispatchMode):
    """Counts reads of a tensor's value back to the host (`.item()`, `bool(t)`, `.tolist()`): each is a wait for
    the device on a GPU."""

    def __init__(self):
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is torch.ops.aten._local_scalar_dense.default:
            self.count += 1
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("positions", ["none", "one row for the batch", "one row each"])
def test_a_forward_reads_the_positions_back_once_not_once_per_layer(positions, monkeypatch):
    """Deciding whether a batch is packed reads `position_ids` back (a wait for the GPU); every layer gets the same
    tensor, so it is read once per forward whatever the number of layers and whatever its batch dimension. (Readings
    are remembered on a GPU only: here CPU tensors stand in for GPU ones.)"""
    from flashsys.ops.attention import readback

    monkeypatch.setattr(readback, "cacheable", lambda t: True)
    ref, ours = _pair("llama-gqa", num_hidden_layers=6)
    x = _tokens(2, 12)
    given = {"none": None, "one row for the batch": torch.arange(12)[None],
             "one row each": torch.arange(12)[None].repeat(2, 1)}[positions]
    counts = []
    for model in (ref, ours):
        with torch.no_grad(), _DeviceReads() as reads:
            model(x, position_ids=given, use_cache=False)
        counts.append(reads.count)
    assert counts[1] <= counts[0] + 1, f"sdpa's forward reads back {counts[0]} times, flashsys' {counts[1]}"


def test_layers_compile_without_a_graph_break_and_packed_rows_still_split():
    """Under torch.compile a layer's call stays in one graph: one new query per row with its positions, no positions
    at all, and queries at the keys' positions, whose packing `flash_attention_packed` reads when the graph runs;
    packed positions still take the varlen kernels."""
    module = torch.nn.Module()
    q1, k, v = (torch.randn(2, 4, n, 16, dtype=torch.float64) for n in (1, 10, 10))
    whole = torch.arange(10)[None]
    for query, extra in ((q1, {"position_ids": torch.full((2, 1), 9)}), (torch.randn(2, 4, 10, 16).double(), {}),
                         (torch.randn(2, 4, 10, 16).double(), {"position_ids": whole})):
        torch._dynamo.reset()
        compiled = torch.compile(attention_forward, backend="eager", fullgraph=True)
        out, _ = compiled(module, query, k, v, None, **extra)
        expected = torch.nn.functional.scaled_dot_product_attention(
            query, k, v, attn_mask=torch.ones(query.shape[2], 10, dtype=torch.bool).tril(10 - query.shape[2]))
        torch.testing.assert_close(out, expected.transpose(1, 2), rtol=1e-10, atol=1e-10)
    torch._dynamo.reset()
    positions = torch.cat([torch.arange(4), torch.arange(6)])[None].expand(2, -1)
    compiled = torch.compile(attention_forward, backend="eager", fullgraph=True)
    out, _ = compiled(module, k, k, v, None, position_ids=positions)
    documents = [torch.nn.functional.scaled_dot_product_attention(k[..., a:b, :], k[..., a:b, :], v[..., a:b, :],
                                                                  is_causal=True) for a, b in ((0, 4), (4, 10))]
    torch.testing.assert_close(out, torch.cat(documents, 2).transpose(1, 2), rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("rows", ["whole rows", "packed rows", "collated rows", "padded rows"])
def test_a_compiled_training_step_is_one_graph_and_matches_eager(rows):
    """A compiled model's forward and backward make one graph (no break in any layer, where reading the positions,
    the collator's offsets or the padding mask back used to split each), with the eager model's loss and gradients."""
    _, ours = _pair("qwen2-mixed")
    ours.train()
    x = _tokens(2, 16)
    inputs = {"whole rows": {"position_ids": torch.arange(16)[None]},
              "packed rows": {"position_ids": torch.cat([torch.arange(9), torch.arange(7)])[None]},
              "collated rows": {"position_ids": torch.cat([torch.arange(9), torch.arange(7), torch.arange(16)])[None],
                                "cu_seq_lens_q": torch.tensor([0, 9, 16, 32], dtype=torch.int32),
                                "cu_seq_lens_k": torch.tensor([0, 9, 16, 32], dtype=torch.int32),
                                "max_length_q": 16, "max_length_k": 16},
              "padded rows": {"attention_mask": torch.stack([torch.arange(16) >= 5, torch.arange(16) < 12]).long()},
              }[rows]
    if rows == "collated rows":  # a flattening collator's one row
        x = x.reshape(1, -1)

    def loss(model):
        model.zero_grad(set_to_none=True)
        out = model(x, labels=x, use_cache=False, **inputs).loss
        out.backward()
        return out.detach(), [p.grad for p in model.parameters()]

    torch._dynamo.reset()
    explained = torch._dynamo.explain(lambda: ours(x, labels=x, use_cache=False, **inputs).loss)()
    assert explained.graph_break_count == 0, [b.reason.splitlines()[0] for b in explained.break_reasons]
    eager_loss, eager_grads = loss(ours)
    torch._dynamo.reset()
    compiled_loss, compiled_grads = loss(torch.compile(ours, backend="aot_eager"))
    torch.testing.assert_close(compiled_loss, eager_loss, rtol=1e-12, atol=1e-12)
    for got, expected in zip(compiled_grads, eager_grads):
        torch.testing.assert_close(got, expected, rtol=1e-10, atol=1e-12)


class _Copies(torch.utils._python_dispatch.TorchDispatchMode):
    """Counts the ops that copy a tensor into a new layout (a reshape that is no view runs `clone`)."""

    def __init__(self):
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.overloadpacket in (torch.ops.aten.clone, torch.ops.aten.contiguous):
            self.count += 1
        return func(*args, **(kwargs or {}))


def test_a_training_step_through_the_triton_kernels_copies_no_more_than_sdpa(monkeypatch):
    """transformers transposes each layer's output back to (B, N, H * D) and its gradients land on (B, N, H, D)
    views: the Triton op returns O, dQ, dK, dV in those layouts (`flashsys.ops.attention.layout`), so a training
    step makes the copies sdpa's makes and no more (dense (B, H, N, D) outputs cost two more a layer here). The
    Triton kernels run in the interpreter on a CPU, in float32."""
    import functools

    import flashsys.integrations.transformers as integration
    from flashsys.ops.attention import flash_attention, flash_attention_packed, get_backend

    if (why := get_backend("flash-triton").unavailable_reason("cpu")) is not None:
        pytest.skip(why)
    monkeypatch.setattr(integration, "flash_attention", functools.partial(flash_attention, backend="triton"))
    monkeypatch.setattr(integration, "flash_attention_packed",
                        functools.partial(flash_attention_packed, backend="triton"))
    ref, ours = _pair("llama-gqa", num_hidden_layers=3)
    x = _tokens(2, 20)
    counts = []
    for model in (ref, ours):
        model.float().train()
        with _Copies() as copies:
            model(x, labels=x, use_cache=False).loss.backward()
        counts.append(copies.count)
    assert counts[1] <= counts[0], f"sdpa's step copies {counts[0]} times, flashsys' {counts[1]}"


@pytest.mark.parametrize("family", ["llama-gqa", "mistral-window"])
@pytest.mark.parametrize("side", ["left", "right"])
def test_padded_batches_match_at_every_real_token(family, side):
    ref, ours = _pair(family)
    x = _tokens(3, 16)
    mask = torch.ones(3, 16, dtype=torch.long)
    if side == "left":
        mask[0, :5], mask[2, :11] = 0, 0
    else:
        mask[0, 12:], mask[1, 3:] = 0, 0
    real = mask.bool()
    a, b = ref(x, attention_mask=mask).logits, ours(x, attention_mask=mask).logits
    torch.testing.assert_close(b[real], a[real], rtol=1e-10, atol=1e-10)
    assert torch.isfinite(b).all()


@pytest.mark.parametrize("family", ["llama-gqa", "mistral-window", "qwen2-mixed"])
def test_greedy_generation_of_a_left_padded_batch_gives_sdpas_tokens(family, monkeypatch):
    """Left padding: the prompt through the varlen kernels, every new token through `flash_attention_decode`, which
    skips each row's padding in the cache."""
    from flashsys.integrations import transformers as integration

    starts = []
    decode = integration.flash_attention_decode
    monkeypatch.setattr(integration, "flash_attention_decode",
                        lambda *a, cache_start, **kw: starts.append(cache_start.tolist()) or decode(
                            *a, cache_start=cache_start, **kw))
    ref, ours = _pair(family)
    x = _tokens(3, 9, seed=4)
    mask = torch.ones(3, 9, dtype=torch.long)
    mask[1, :6], mask[2, :2] = 0, 0  # row 1's padding stays in a 6-key sliding window cache for two steps
    kwargs = dict(attention_mask=mask, max_new_tokens=12, do_sample=False, pad_token_id=0)
    torch.testing.assert_close(ours.generate(x, **kwargs), ref.generate(x, **kwargs), rtol=0, atol=0)
    assert starts and all(s[0] == 0 and s[1] > 0 for s in starts)
    if family == "llama-gqa":  # every layer of the 11 steps after the prompt, the cache's padding at its start
        assert len(starts) == 11 * 2 and starts[0] == [0, 6, 2]
    starts.clear()
    unpadded = dict(max_new_tokens=12, do_sample=False, pad_token_id=0)  # the dense decode path: no mask at all
    torch.testing.assert_close(ours.generate(x, **unpadded), ref.generate(x, **unpadded), rtol=0, atol=0)
    assert not starts


@pytest.mark.parametrize("prompt", [9, 3], ids=["prompt-past-the-window", "prompt-inside-the-window"])
@pytest.mark.parametrize("family", ["llama-gqa", "mistral-window", "qwen2-mixed"])
def test_generation_with_a_static_cache_gives_sdpas_tokens(family, prompt):
    """A static cache hands every layer all its slots, the empty ones after the keys so far included: a prompt's
    mask ends where its keys end, a decoding step's key mask hides the empty slots (the sliding layers' static
    caches fill, then roll)."""
    ref, ours = _pair(family)
    x = _tokens(3, prompt, seed=5)
    mask = torch.ones(3, prompt, dtype=torch.long)
    mask[1, :prompt - 3], mask[2, :2] = 0, 0
    for kwargs in (dict(attention_mask=mask), {}):
        kwargs.update(max_new_tokens=10, do_sample=False, pad_token_id=0, cache_implementation="static")
        torch.testing.assert_close(ours.generate(x, **kwargs), ref.generate(x, **kwargs), rtol=0, atol=0)


@pytest.mark.filterwarnings("ignore:`past_key_values` is deprecated")  # its successor `cache` is newer than 5.17
def test_a_static_cache_without_a_mask_attends_to_the_keys_so_far_only():
    """A forward call given a half-empty static cache and no mask: its empty slots are not keys."""
    ref, ours = _pair("llama-gqa")
    x = _tokens(2, 12, seed=6)
    logits = []
    for model in (ref, ours):
        cache = transformers.StaticCache(config=model.config, max_cache_len=32)
        model(x[:, :8], past_key_values=cache, use_cache=True)
        logits.append(model(x[:, 8:], past_key_values=cache, use_cache=True).logits)
    torch.testing.assert_close(logits[1], logits[0], rtol=1e-10, atol=1e-10)


@pytest.mark.filterwarnings("ignore:`past_key_values` is deprecated")
@pytest.mark.parametrize("cache_kind", ["static", "dynamic"])
def test_a_compiled_decoding_step_of_a_padded_batch_is_one_graph(cache_kind):
    """What `generate()` compiles for a static cache (and a dynamic one compiled by hand): one query per row, a
    padded batch, fullgraph; the mask is made on the device and every layer runs `flashsys::flash_attention_decode`
    with it (nothing read back)."""
    ref, ours = _pair("llama-gqa")
    x = _tokens(3, 9, seed=7)
    mask = torch.ones(3, 9, dtype=torch.long)
    mask[1, :6], mask[2, :2] = 0, 0
    step_ids, step_mask = _tokens(3, 1, seed=8), torch.cat([mask, torch.ones(3, 1, dtype=torch.long)], 1)
    logits, ops = [], []

    def recording(gm, inputs):
        ops.extend(str(n.target) for n in gm.graph.nodes if n.op in ("call_function", "call_method"))
        return gm.forward

    for model in (ref, ours):
        cache = (transformers.StaticCache(config=model.config, max_cache_len=24) if cache_kind == "static" else
                 transformers.DynamicCache(config=model.config))
        with torch.no_grad():
            model(x, attention_mask=mask, past_key_values=cache, use_cache=True)
            torch._dynamo.reset()
            step = torch.compile(model, fullgraph=True, backend=recording if model is ours else "aot_eager")
            logits.append(step(step_ids, attention_mask=step_mask, past_key_values=cache, use_cache=True).logits)
    torch.testing.assert_close(logits[1], logits[0], rtol=1e-10, atol=1e-10)
    assert sum("flashsys.flash_attention_decode" in op for op in ops) == ours.config.num_hidden_layers
    assert not {"item", "tolist"} & set(ops)  # under fullgraph a read would have failed the compile already


def test_generate_compiles_its_static_cache_decoding_step_into_one_graph():
    """transformers' own compiled generation (a static cache; `_compile_all_devices` lets it compile on a CPU), with
    fullgraph: one graph holding a decode op per layer, and sdpa's tokens."""
    ref, ours = _pair("llama-gqa")
    x = _tokens(3, 9, seed=9)
    mask = torch.ones(3, 9, dtype=torch.long)
    mask[1, :6], mask[2, :2] = 0, 0
    graphs = []

    def counting(gm, inputs):
        graphs.append(sum("flash_attention_decode" in str(n.target) for n in gm.graph.nodes))
        return gm.forward

    config = transformers.CompileConfig(fullgraph=True, mode="default", backend=counting)
    config._compile_all_devices = True
    out = []
    for model in (ref, ours):
        torch._dynamo.reset()
        out.append(model.generate(x, attention_mask=mask, max_new_tokens=8, do_sample=False, pad_token_id=0,
                                  cache_implementation="static", compile_config=config))
    torch.testing.assert_close(out[1], out[0], rtol=0, atol=0)
    assert graphs == [0, ours.config.num_hidden_layers]  # sdpa's graph, then ours: each compiled once


def _layer_call(**kwargs):
    """One direct call of the attention function on a Llama attention layer, as transformers makes it."""
    _, ours = _pair("llama-gqa")
    module = ours.model.layers[0].self_attn
    g = torch.Generator().manual_seed(3)
    q = torch.randn(2, 4, 10, 16, generator=g, dtype=torch.float64)
    k, v = (torch.randn(2, 2, 10, 16, generator=g, dtype=torch.float64) for _ in range(2))
    args = dict(attention_mask=None, scaling=0.25)
    args.update(kwargs)
    return module, q, k, v, attention_forward(module, q, k, v, **args)


def test_a_non_causal_layer_attends_both_ways_as_sdpa():
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    module, q, k, v, (out, weights) = _layer_call(is_causal=False)
    expected, _ = sdpa_attention_forward(module, q, k, v, None, scaling=0.25, is_causal=False)
    assert weights is None
    torch.testing.assert_close(out, expected, rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("kwargs,match", [
    (dict(dropout=0.1), "attention dropout 0.1"),
    (dict(softcap=30.0), "softcapping"),
    (dict(s_aux=torch.zeros(4)), "attention sinks"),
    (dict(position_bias=torch.zeros(1, 4, 10, 10)), "position biases"),
    (dict(attention_mask=torch.zeros(2, 1, 10, 10)), "the attention mask is a 4-D"),
    (dict(attention_mask=torch.tensor([[1, 1, 0, 1, 1, 1, 1, 1, 1, 1]] * 2, dtype=torch.bool)), "between real tokens"),
    (dict(sliding_window=0), "sliding_window must be a positive int"),
], ids=["dropout", "softcap", "sinks", "position-bias", "4d-mask", "mask-with-holes", "window-0"])
def test_what_flashsys_does_not_compute_is_refused_by_name(kwargs, match):
    with pytest.raises(ValueError, match=match):
        _layer_call(**kwargs)


def test_models_flashsys_cannot_run_are_refused_clearly():
    with pytest.raises(ValueError, match="head_dim 288 is above"):
        _, ours = _pair("qwen3", head_dim=288)
        ours(_tokens(1, 4))
    with pytest.raises(ValueError, match="value head dim 8 differ"):
        module, q, k, v, _ = _layer_call()
        attention_forward(module, q, k, v[..., :8], None)
    _, ours = _pair("llama-gqa", attention_dropout=0.2)
    ours.eval()(_tokens(1, 4))  # dropout applies in training only
    with pytest.raises(ValueError, match="attention_dropout=0.0"):
        ours.train()(_tokens(1, 4))
    gemma = transformers.Gemma2ForCausalLM._from_config(
        transformers.Gemma2Config(**SMALL, num_key_value_heads=2, head_dim=16, attn_logit_softcapping=50.0),
        attn_implementation=register())
    with pytest.raises(ValueError, match="attn_logit_softcapping=50.0"):
        gemma(_tokens(1, 4))
    with pytest.raises(ValueError, match="containing 'flash'"):
        register("flashsys")


def test_a_mask_that_does_not_cover_the_keys_so_far_is_refused():
    """Four positions so far (three cached, one new) and a mask over two: which keys are padding is unknown."""
    from flashsys.integrations.transformers import padding_mask

    with pytest.raises(ValueError, match="the attention mask has 2 columns, but the cache holds 4 keys"):
        padding_mask(2, 1, 10, q_offset=3, attention_mask=torch.ones(2, 2, dtype=torch.bool))
    assert padding_mask(2, 1, 10, q_offset=3, attention_mask=torch.ones(2, 4, dtype=torch.bool)).shape == (2, 4)


def test_the_mask_function_takes_the_queries_positions_as_transformers_before_5_4_passes_them():
    """transformers 4.56–5.3 calls the mask function with `cache_position` (the queries' positions) where later
    versions pass q_length and q_offset: both describe the same keys."""
    from flashsys.integrations.transformers import padding_mask

    mask = torch.ones(2, 9, dtype=torch.bool)
    mask[1, :3] = False
    for n_q, n_k, offset in ((9, 9, 0), (9, 12, 0), (4, 9, 5), (1, 12, 8)):  # training, static prompt, chunk, step
        given = mask[:, :offset + n_q]
        old = padding_mask(batch_size=2, cache_position=torch.arange(offset, offset + n_q), kv_length=n_k,
                           kv_offset=0, attention_mask=given)
        new = padding_mask(2, n_q, n_k, q_offset=offset, kv_offset=0, attention_mask=given)
        assert torch.equal(old, new) and old.shape == (2, offset + n_q), (n_q, n_k, offset)
    assert padding_mask(batch_size=2, cache_position=torch.arange(9), kv_length=9, attention_mask=None) is None
    with pytest.raises(TypeError, match="neither q_length nor cache_position"):
        padding_mask(batch_size=2, kv_length=9)
