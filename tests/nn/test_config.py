"""ModelConfig and the preset registry: one definition of a model's shape, validated with clear errors."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from flashsys.nn import PRESETS, ModelConfig, TransformerLM, preset


def test_presets_hold_the_size_table_and_the_cpu_models():
    table = {"small": (768, 3072, 12, 12), "medium": (1024, 4096, 24, 16), "large": (1280, 5120, 36, 20),
             "xl": (1600, 6400, 48, 25), "2.7B": (2560, 10240, 32, 32)}
    for name, (d_model, d_ff, layers, heads) in table.items():
        c = PRESETS[name]
        assert (c.d_model, c.d_ff, c.num_layers, c.num_heads) == (d_model, d_ff, layers, heads), name
    assert PRESETS["demo"].vocab_size == 256  # byte-level, what `flashsys train` trains
    assert {"demo", "tiny"} <= PRESETS.keys()


def test_preset_replaces_fields_and_leaves_the_registry_alone():
    c = preset("small", context_length=2048, attention_backend="sdpa")
    assert c.context_length == 2048 and c.attention_backend == "sdpa" and c.d_model == 768
    assert PRESETS["small"].context_length == 512
    with pytest.raises(dataclasses.FrozenInstanceError):
        c.d_model = 1  # type: ignore[misc]
    with pytest.raises(ValueError, match="unknown preset"):
        preset("huge")


def test_from_config_and_the_positional_constructor_build_the_same_model():
    cfg = preset("demo", vocab_size=61, context_length=16, d_model=32, num_layers=1, num_heads=2, d_ff=64)
    torch.manual_seed(0)
    a = TransformerLM.from_config(cfg)
    torch.manual_seed(0)
    b = TransformerLM(61, 16, 32, 1, 2, 64)
    assert a.config == b.config == cfg
    for (na, pa), (nb, pb) in zip(a.named_parameters(), b.named_parameters()):
        assert na == nb and torch.equal(pa, pb)


@pytest.mark.parametrize("changes,match", [
    (dict(num_heads=0), "num_heads must be a positive integer"),
    (dict(d_model=30, num_heads=4), "divisible"),
    (dict(d_model=12, num_heads=4), "even head_dim"),
    (dict(vocab_size=True), "vocab_size"),
    (dict(attention_backend="cudnn"), "unknown attention backend"),
])
def test_validate_names_the_bad_field(changes, match):
    with pytest.raises(ValueError, match=match):
        PRESETS["demo"].replace(**changes).validate()


def test_set_attention_backend_updates_the_config():
    model = TransformerLM.from_preset("demo", d_model=32, num_heads=2, d_ff=64, num_layers=1)
    model.set_attention_backend("triton")  # a short flash name is normalised to the registry's
    assert model.config.attention_backend == "flash-triton"
    assert all(layer.attn.attention_backend == "flash-triton" for layer in model.layers)
    assert isinstance(model.config, ModelConfig)


@pytest.mark.parametrize("changes,match", [
    (dict(num_kv_heads=3), r"num_heads \(4\) must be a multiple of num_kv_heads \(3\)"),
    (dict(num_kv_heads=0), "num_kv_heads must be None or an integer >= 1"),
    (dict(attention_window=-1), "attention_window must be None or an integer >= 0"),
    (dict(attention_window=2.5), "attention_window must be None or an integer >= 0"),
])
def test_grouped_heads_and_window_are_validated(changes, match):
    with pytest.raises(ValueError, match=match):
        preset("demo", **changes).validate()
