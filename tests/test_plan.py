"""`flashsys plan` and the trainer's memory check: the accounting against what the models and optimizers hold."""

from __future__ import annotations

import pytest
import torch

from flashsys.__main__ import main
from flashsys.nn import TransformerLM, preset
from flashsys.plan import (
    DEVICES,
    STRATEGIES,
    activation_bytes,
    parameter_count,
    plan,
    recommend,
    smallest_world,
)


@pytest.mark.parametrize("name,kv_heads", [("small", None), ("xl", None), ("2.7B", 8)])
def test_parameters_are_counted_as_the_model_holds_them(name, kv_heads):
    config = preset(name, num_kv_heads=kv_heads)
    with torch.device("meta"):
        model = TransformerLM.from_config(config)
    assert parameter_count(config) == sum(p.numel() for p in model.parameters())


def test_state_per_rank_follows_each_strategy():
    """fp32 weights and gradients (4 bytes a parameter), AdamW's moments (8); sharded by 1/world where the strategy
    shards them. ZeRO-2's gradients and state of the xl preset on 2 ranks: the 11,434 MB benchmarks.ddp measured."""
    config = preset("xl")
    n = parameter_count(config)
    plans = {s: plan(config, 2, 16, s, DEVICES["h200"]) for s in STRATEGIES}
    assert plans["ddp"].memory.parameters == 4 * n and plans["ddp"].memory.optimizer == 8 * n
    assert plans["zero1"].memory.optimizer == 4 * n and plans["zero1"].memory.gradients == 4 * n
    assert plans["zero2"].memory.gradients == 2 * n and plans["zero2"].memory.optimizer == 4 * n
    assert plans["zero3"].memory.parameters == 2 * n
    # Autocast's bf16 copies of the weights (2 bytes each, LM head included, embedding not): not under ZeRO-3,
    # whose gathered blocks are bf16 already.
    copies = 2 * (n - config.vocab_size * config.d_model)
    assert plans["zero2"].memory.activations - plans["zero3"].memory.activations == copies
    zero2_state = plans["zero2"].memory.gradients + plans["zero2"].memory.optimizer
    assert abs(zero2_state / 2**20 - 11434) / 11434 < 0.01
    assert plans["zero2"].comm_bytes == plans["ddp"].comm_bytes < plans["zero1"].comm_bytes
    assert recommend(list(plans.values())).strategy == "zero2"  # ddp's time and fewer bytes; zero3 gathers per block


def test_activations_are_estimated_from_what_backward_keeps():
    """The estimate against the bytes autograd actually saves in a CPU float32 forward (each storage once)."""
    for name in ("tiny", "small"):
        config = preset(name, context_length=128, attention_backend="flash-torch")
        model = TransformerLM.from_config(config)
        params = {p.untyped_storage().data_ptr() for p in model.parameters()}
        saved = {}

        def pack(t):
            if t.untyped_storage().data_ptr() not in params:
                saved[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
            return t

        x = torch.randint(0, config.vocab_size, (2, 128))
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            logits = model(x)
            torch.nn.functional.cross_entropy(logits.float().reshape(-1, config.vocab_size), x.reshape(-1))
        estimate = activation_bytes(config, 2 * 128, "float32", checkpointing=False)
        assert 0.8 < estimate / sum(saved.values()) < 1.2, (name, estimate, sum(saved.values()))
        assert activation_bytes(config, 256, "float32", checkpointing=True) < 0.7 * estimate


def test_the_plan_command_recommends_or_says_what_would_hold_it(capsys):
    assert main(["plan", "--preset", "xl", "--world-size", "2", "--batch-size", "32", "--device", "h200"]) == 0
    out = capsys.readouterr().out
    assert "recommended: zero2 (flashsys train --zero-stage 2)" in out and "| zero3 |" in out
    assert main(["plan", "--preset", "2.7B", "--world-size", "2", "--batch-size", "256", "--context-length",
                 "4096"]) == 1
    assert "nothing fits on 2 x H100 80GB" in capsys.readouterr().out
    found = smallest_world(preset("2.7B", context_length=1024), 8, DEVICES["h100"], "bfloat16", True)
    assert found is not None and found[0] >= 1
    assert main(["plan", "--world-size", "1", "--strategy", "zero2"]) == 2
    assert "nothing to shard" in capsys.readouterr().err


def test_the_trainer_refuses_what_the_plan_says_cannot_fit_and_names_what_would(monkeypatch, capsys):
    import flashsys.cli as cli

    config = preset("xl", vocab_size=256)
    floor = {s: plan(config, 2, 1, s, DEVICES["h200"]).floor for s in ("ddp", "zero2")}
    # A machine with room for ZeRO-2's floor but not DDP's: --no-shard is refused, naming --zero-stage 2.
    room = (floor["ddp"] + floor["zero2"]) / 2
    monkeypatch.setattr(cli, "_available_bytes", lambda on_gpu: 2 * room)
    args = ["train", "--preset", "xl", "--world-size", "2", "--batch-size", "2", "--context-length", "512",
            "--out", "/tmp/flashsys-plan-test"]
    assert main([*args, "--no-shard"]) == 2
    err = capsys.readouterr().err
    assert "needs at least" in err and "--zero-stage 2 would fit" in err
