"""Every benchmark script runs at a tiny scale on this machine and writes its table, CSV and plot."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parent.parent

CASES = {
    "attention": (["--seq-lens", "64", "--head-dims", "16", "--impls", "naive", "flash-torch", "sdpa-math",
                   "--rounds", "2"],
                  ["attention_cpu.md", "attention_cpu.csv", "attention_cpu_fp32_causal.png"]),
    "end_to_end": (["--presets", "tiny", "--contexts", "32", "--iters", "2", "--warmup", "1"],
                   ["end_to_end_cpu_fp32_flash_w1.md", "end_to_end_cpu_fp32_flash_w1.csv", "end_to_end_cpu_fp32_flash_w1.png"]),
    "attention_features": (["--seq-lens", "32", "--window-seq-lens", "48", "--total", "90"],
                           ["attention_features_cpu.md", "attention_features_cpu.csv"]),
    "host_cost": (["--seqs", "16", "--calls", "2", "--heads", "2", "--head-dim", "16", "--breakdown", "--compiled"],
                  ["host_cost_cpu.md", "host_cost_cpu.csv", "host_cost_cpu_breakdown.md"]),
    "allreduce": (["--sizes-mb", "0.1", "1", "--world-sizes", "2", "--iters", "2", "--warmup", "1", "--backend", "gloo"],
                  ["allreduce_gloo.md", "allreduce_gloo.csv", "allreduce_gloo.png"]),
    "ddp": (["--rounds", "1", "--iters", "2", "--warmup", "1", "--context", "16", "--backend", "gloo"],
            ["ddp_gloo_w2.md", "ddp_gloo_w2.csv", "ddp_gloo_w2.png"]),
    "decode": (["--batches", "1", "--cache-lens", "512"], ["decode_cpu.md", "decode_cpu.csv"]),
    "hf_model": ([], ["hf_model_cpu_train.md", "hf_model_cpu_train.csv", "hf_model_cpu_generate.md"]),
    "sharded_optimizer": (["--iters", "1", "--warmup", "0", "--context", "16", "--backend", "gloo"],
                          ["sharded_optimizer_gloo.md", "sharded_optimizer_gloo.csv", "sharded_optimizer_gloo.png"]),
}


def _run(script, *args, timeout=300):
    """`python -m benchmarks.<script> ARGS` from the repository root, as the README runs them."""
    return subprocess.run([sys.executable, "-m", f"benchmarks.{script}", *args], capture_output=True, text=True,
                          timeout=timeout, cwd=ROOT)


@pytest.mark.parametrize("script", list(CASES))
def test_benchmark_script_runs_and_writes_results(script, tmp_path):
    args, outputs = CASES[script]
    r = _run(script, *args, "--out", str(tmp_path), "--no-progress")
    assert r.returncode == 0, r.stderr[-3000:]
    for name in outputs:
        assert (tmp_path / name).is_file(), f"{name} missing; have {sorted(p.name for p in tmp_path.iterdir())}"
    table = (tmp_path / outputs[0]).read_text()
    assert "- device:" in table and "- command:" in table and "| " in table


@pytest.mark.parametrize("script", list(CASES) + ["leaderboard"])
def test_benchmark_help(script):
    r = _run(script, "--help", timeout=120)
    assert r.returncode == 0 and "usage" in r.stdout


def test_host_cost_breakdown_times_the_plans_replays(tmp_path):
    """The breakdown looks the eager call's plans up by their keys and times their replays; a key it builds
    differently from the op's finds no plan, and those rows would drop out of the table without an error."""
    r = _run("host_cost", "--seqs", "16", "--calls", "2", "--rounds", "1", "--heads", "2", "--head-dim", "16",
             "--dtype", "float32", "--breakdown", "--out", str(tmp_path), "--no-progress")
    assert r.returncode == 0, r.stderr[-3000:]
    table = (tmp_path / "host_cost_cpu_breakdown.md").read_text()
    for part in ("forward plan: signature (key) + look-up", "backward plan: signature (key) + look-up",
                 "backward plan: allocations + its launches (BackwardPlan.launch)"):
        assert f"| {part} |" in table, part
    assert "none under the key" not in table


def test_host_cost_breakdown_names_a_plan_it_does_not_find(tmp_path):
    """Where no plan is found (bf16 under the interpreter makes none), the table says so in a row of its own for
    each, with the size of the plan table looked in, instead of dropping the replay rows silently."""
    r = _run("host_cost", "--seqs", "16", "--calls", "2", "--rounds", "1", "--heads", "2", "--head-dim", "16",
             "--dtype", "bfloat16", "--breakdown", "--out", str(tmp_path), "--no-progress")
    assert r.returncode == 0, r.stderr[-3000:]
    table = (tmp_path / "host_cost_cpu_breakdown.md").read_text()
    for what in ("forward", "backward"):
        assert f"| {what} plan: none under the key built here (0 in its table), not timed | — |" in table, what
    assert "plan: signature (key) + look-up" not in table


def test_leaderboard_without_cuda_says_so():
    r = _run("leaderboard", timeout=120)
    assert r.returncode == 0 and "CUDA" in r.stdout


def test_a_failing_cell_is_recorded_not_fatal():
    from benchmarks.harness import run_cell

    def boom():
        raise RuntimeError("CUDA out of memory. Tried to allocate 2 GiB")

    assert run_cell(boom)["error"] == "OOM"
    assert run_cell(lambda: (_ for _ in ()).throw(NotImplementedError("no")))["error"].startswith("unsupported")


def test_attention_rounds_take_each_times_median_and_keep_a_failure():
    """`benchmarks.attention --rounds`: each time of a cell is the median over its interleaved rounds (not, say, the
    last round's or the mean), TFLOP/s follows the median forward + backward, and a round that failed fails the cell."""
    from benchmarks.attention import median_of_rounds

    runs = [{"fwd_ms": f, "bwd_ms": b, "fwd_bwd_ms": fb, "peak_mem_MB": m}  # what `measure` returns
            for f, b, fb, m in ((1.0, 9.0, 4.0, 10.0), (3.0, 2.0, 100.0, 11.0), (2.0, 1.0, 5.0, 12.0))]
    out = median_of_rounds(runs, (3e9, 7e9))
    assert (out["fwd_ms"], out["bwd_ms"], out["fwd_bwd_ms"], out["peak_mem_MB"]) == (2.0, 2.0, 5.0, 10.0)
    assert out["fwd_bwd_TFLOPs"] == 1e10 / 5.0 / 1e9
    failed = {"error": "OOM", "detail": "CUDA out of memory"}
    assert median_of_rounds([runs[0], failed], (1.0, 1.0)) == failed


def test_a_disturbed_forward_and_backward_is_timed_again_and_the_lowest_kept(monkeypatch):
    """`benchmarks.attention.time_within`: a timing past the bound (a forward + backward slower than its own forward
    plus backward allow) is taken again, at most `tries` timings in all, the lowest kept; one within it is kept as
    is, and the count of re-timings comes back for the table's note."""
    import benchmarks.attention as attention

    def timings(*values):
        it = iter(values)
        monkeypatch.setattr(attention, "bench_ms", lambda fn, rep: next(it))

    timings(1.0)
    assert attention.time_within(None, 10, bound_ms=1.5) == (1.0, 0)
    timings(2.0, 1.2, 9.0)
    assert attention.time_within(None, 10, bound_ms=1.5) == (1.2, 1)
    timings(2.0, 3.0, 1.8, 0.1)
    assert attention.time_within(None, 10, bound_ms=1.5) == (1.8, 2)


def test_an_attention_table_names_the_cells_timed_again(tmp_path, monkeypatch):
    import benchmarks.attention as attention

    def fake_measure(name, fn, batch, heads, n, *rest, **options):
        return {"fwd_ms": 1.0, "bwd_ms": 2.0, "fwd_bwd_ms": 3.0, "peak_mem_MB": 1.0, "retimed": int(name == "naive")}

    monkeypatch.setattr(attention, "measure_impl", fake_measure)
    assert attention.main(["--seq-lens", "64", "--head-dims", "16", "--impls", "naive", "sdpa-math", "--rounds", "2",
                           "--out", str(tmp_path), "--no-progress"]) == 0
    table = (tmp_path / "attention_cpu.md").read_text()
    assert "timed again" in table and "naive fp32 D 16 N 64 causal (2×)" in table and "sdpa-math fp32" not in table


def test_attention_rounds_change_the_implementations_order(tmp_path, monkeypatch):
    """`benchmarks.attention --rounds 4` over four implementations takes them in `round_order`'s rounds: each one
    first once, and after each of the others once, so a cell's medians do not keep the bias of one fixed order."""
    import benchmarks.attention as attention

    calls = []

    def fake_measure(name, fn, batch, heads, n, *rest, **options):
        calls.append(name)
        return {"fwd_ms": 1.0, "bwd_ms": 2.0, "fwd_bwd_ms": 3.0, "peak_mem_MB": 1.0, "retimed": 0}

    monkeypatch.setattr(attention, "measure_impl", fake_measure)
    impls = ["naive", "sdpa-math", "sdpa", "flash-torch"]
    assert attention.main(["--seq-lens", "64", "--head-dims", "16", "--causal", "yes", "--impls", *impls, "--rounds",
                           "4", "--out", str(tmp_path), "--no-progress"]) == 0
    rounds = [calls[i:i + 4] for i in range(0, 16, 4)]
    assert rounds[0] == impls and sorted(r[0] for r in rounds) == sorted(impls)
    assert {(r[i - 1], r[i]) for r in rounds for i in range(1, 4)} == {(a, b) for a in impls for b in impls if a != b}
    assert "order changed each round" in (tmp_path / "attention_cpu.md").read_text()


def test_an_attention_sweep_stopped_midway_keeps_the_cells_it_finished(tmp_path, monkeypatch):
    """The sweep writes its table after every cell, marked partial until the last: a run cut off (a timeout's kill,
    here an interrupt in the second cell's timing) leaves the first cell's rows, ratios included, on disk."""
    import benchmarks.attention as attention

    def fake_measure(name, fn, batch, heads, n, *rest, **options):
        if n == 128:
            raise KeyboardInterrupt  # not an Exception: run_cell lets it through, as a kill would stop the run
        return {"fwd_ms": 1.0, "bwd_ms": 2.0, "fwd_bwd_ms": 3.0 if name == "naive" else 4.0, "peak_mem_MB": 1.0}

    monkeypatch.setattr(attention, "measure_impl", fake_measure)
    with pytest.raises(KeyboardInterrupt):
        attention.main(["--seq-lens", "64", "128", "--head-dims", "16", "--impls", "naive", "sdpa-math",
                        "--out", str(tmp_path), "--no-progress"])
    table = (tmp_path / "attention_cpu.md").read_text()
    assert "**Partial: 1 of 2 cells**" in table
    rows = (tmp_path / "attention_cpu.csv").read_text().splitlines()
    assert len(rows) == 3 and all(",64," in r for r in rows[1:])  # the header and the first cell's two rows
    assert rows[1].endswith(",0.75")  # naive's 3 ms over sdpa-math's 4


def test_attention_beside_fa4_on_its_layout_and_a_row_where_it_is_missing(tmp_path):
    """`--layout bnhd` times every implementation on (B, N, H, D) memory (the gradients land in those leaves);
    FlashAttention-4 gets a row either way: its times and ratios where it runs, why not where it does not (no CUDA
    here, and the package is optional)."""
    import benchmarks.attention as attention

    ran = attention.measure(lambda q, k, v, causal: q.mul(2) + k + v, 2, 3, 8, 4, torch.float32, True, 1,
                            layout="bnhd")
    assert set(ran) == {"fwd_ms", "bwd_ms", "fwd_bwd_ms", "peak_mem_MB", "retimed"}
    assert attention.main(["--seq-lens", "32", "--head-dims", "16", "--impls", "flash-torch", "fa4", "fa4-det",
                           "--layout", "bnhd", "--name", "attention_cpu_fa4", "--out", str(tmp_path),
                           "--no-progress"]) == 0
    table = (tmp_path / "attention_cpu_fa4.md").read_text()
    assert "views of (B, N, H, D) memory" in table and "fwd_bwd_vs_fa4_det: over" in table
    for name in ("fa4", "fa4-det"):
        fa4_row = next(line for line in table.splitlines() if line.startswith(f"| {name} "))
        assert "unsupported (" in fa4_row
    rows = [{"impl": "flash-triton", "fwd_ms": 1.2, "fwd_bwd_ms": 3.0}, {"impl": "sdpa-cudnn", "fwd_ms": 1.0,
            "fwd_bwd_ms": 4.0}, {"impl": "fa4", "fwd_ms": 1.0, "fwd_bwd_ms": 2.5},
            {"impl": "fa4-det", "fwd_ms": 1.0, "fwd_bwd_ms": 3.75}, {"impl": "naive", "error": "skipped"}]
    attention.add_vs_best_sdpa(rows)
    assert (rows[0]["fwd_vs_fa4"], rows[0]["fwd_bwd_vs_fa4"], rows[0]["vs_best_sdpa"]) == (1.2, 1.2, 0.75)
    assert rows[0]["fwd_bwd_vs_fa4_det"] == 0.8 and rows[2]["fwd_bwd_vs_fa4_det"] == 2.5 / 3.75
    assert set(rows[4]) == {"impl", "error"}  # a row without times gets no ratios


def test_an_end_to_end_run_stopped_midway_keeps_its_groups_marked_partial(tmp_path, monkeypatch):
    """The end-to-end table is written after every (preset, context, mode) group, each group's implementations
    timed in interleaved rounds; a run cut off in the second group keeps the first, marked partial."""
    import benchmarks.end_to_end as end_to_end

    built = []

    class FakeModel:
        def __init__(self, preset_name, context, attention, mode, args):
            if context == 64:
                raise KeyboardInterrupt  # as a timeout's kill would stop the run
            self.attention, self.times = attention, []
            built.append(self)

        def time_steps(self):
            self.times.append(len(built))

        def result(self):
            return {"step_ms": 2.0 if self.attention == "flash" else 4.0}

    monkeypatch.setattr(end_to_end, "Model", FakeModel)
    with pytest.raises(KeyboardInterrupt):
        end_to_end.main(["--presets", "tiny", "--contexts", "32", "64", "--attention", "flash", "sdpa", "--rounds",
                         "3", "--out", str(tmp_path), "--no-progress"])
    table = (tmp_path / "end_to_end_cpu_fp32_flash-sdpa_w3.md").read_text()
    assert "**Partial: 1 of 2 (preset, context, mode) groups**" in table
    assert [len(m.times) for m in built] == [3, 3]  # both models of the group built before any round
    assert "| 0.500 |" in table  # flash's step over sdpa's


def test_end_to_end_reduce_overhead_mode_runs_and_names_its_rows(tmp_path, monkeypatch):
    """`--modes reduce-overhead` compiles the model with CUDA graphs (on a CPU torch.compile runs it without them):
    its rows say the mode, the table's name carries it, and no peak memory is claimed for it, where the eager row
    beside it reports what `peak_memory` measured (a stand-in here: a CPU measures none)."""
    import contextlib
    import csv

    import benchmarks.end_to_end as end_to_end

    @contextlib.contextmanager
    def measured():
        yield {"peak_mb": 7.0}

    monkeypatch.setattr(end_to_end, "peak_memory", measured)
    assert end_to_end.main(["--presets", "tiny", "--contexts", "32", "--iters", "1", "--warmup", "1", "--modes",
                            "eager", "reduce-overhead", "--out", str(tmp_path), "--no-progress"]) == 0
    rows = list(csv.DictReader(open(tmp_path / "end_to_end_cpu_fp32_flash_eager-reduce-overhead_w1.csv")))
    assert [row["mode"] for row in rows] == ["eager", "reduce-overhead"]
    assert all(float(row["step_ms"]) > 0 for row in rows)
    # On a CPU the host's time to issue a step is the step (host clock both): within timer noise of step_ms.
    assert all(0 < float(row["host_ms"]) <= float(row["step_ms"]) * 1.05 + 0.5 for row in rows)
    assert [row["peak_step_MB"] for row in rows] == ["7.0", ""]


@pytest.mark.parametrize("bad", ["0", "-1", "two"])
def test_attention_rounds_below_one_is_refused_by_name(bad):
    """`--rounds` takes a whole number, 1 or more: anything else stops before any timing, naming the argument."""
    r = _run("attention", "--rounds", bad, timeout=120)
    assert r.returncode == 2 and "argument --rounds" in r.stderr and repr(bad) in r.stderr, r.stderr[-500:]


def test_ddp_scaling_table_holds_the_variants_measured_at_every_world():
    """Weak-scaling efficiency is the smallest world's median over each larger world's; a variant missing at one
    world size has no row (nothing to compare it with)."""
    from benchmarks.ddp import scaling_rows

    def row(name, ms):
        return {"variant": name, "median_ms": ms, "exposed_%": 0.0, "peak_MB": 1.0, "grad_state_MB": 1.0}

    rows = scaling_rows({4: [row("a", 110.0), row("b", 100.0)], 2: [row("a", 99.0), row("c", 1.0)]})
    assert [r["variant"] for r in rows] == ["a"]
    assert rows[0]["ms_w2"] == 99.0 and rows[0]["ms_w4"] == 110.0 and rows[0]["efficiency_w4"] == 0.9


def test_ddp_world_size_below_two_is_refused_by_name():
    r = _run("ddp", "--world-size", "2", "1", timeout=120)
    assert r.returncode == 2 and "--world-size" in r.stderr and "2 or more" in r.stderr, r.stderr[-500:]


def test_hf_sdpa_causal_baseline_is_sdpa_without_the_mask_compile_builds():
    """benchmarks.hf_model's `sdpa_causal` computes what `sdpa` computes on whole unpadded rows (the train part's
    batches); under torch.compile transformers hands `sdpa` a materialised causal mask and `sdpa_causal` none (the
    reason the baseline exists); with a KV cache (queries fewer than keys) it refuses, naming itself."""
    pytest.importorskip("transformers")
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    from benchmarks import hf_model

    hf_model.register_sdpa_causal()
    state = hf_model.build("sdpa", torch.float32, None).state_dict()
    models = {impl: hf_model.build(impl, torch.float32, state).eval() for impl in ("sdpa", hf_model.SDPA_CAUSAL)}
    ids = torch.randint(0, 256, (2, 24), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        logits = {impl: m(input_ids=ids, use_cache=False).logits for impl, m in models.items()}
    torch.testing.assert_close(logits[hf_model.SDPA_CAUSAL], logits["sdpa"], rtol=1e-5, atol=1e-5)

    masks = []
    originals = {impl: ALL_ATTENTION_FUNCTIONS[impl] for impl in models}

    def recording(impl):
        def attention(module, q, k, v, attention_mask, **kwargs):
            masks.append((impl, None if attention_mask is None else attention_mask.dim()))
            return originals[impl](module, q, k, v, attention_mask, **kwargs)
        return attention

    try:
        for impl in models:
            ALL_ATTENTION_FUNCTIONS._global_mapping[impl] = recording(impl)
        with torch.no_grad():
            for impl, m in models.items():
                torch._dynamo.reset()
                torch.compile(m, backend="eager")(input_ids=ids, use_cache=False)
    finally:
        ALL_ATTENTION_FUNCTIONS._global_mapping.update(originals)
        torch._dynamo.reset()
    assert {impl: {dim for i, dim in masks if i == impl} for impl in models} == {"sdpa": {4},
                                                                                  hf_model.SDPA_CAUSAL: {None}}
    with pytest.raises(ValueError, match="sdpa_causal: for training rows only"):
        models[hf_model.SDPA_CAUSAL].generate(ids, max_new_tokens=2, do_sample=False, pad_token_id=0)


def test_hf_train_ratios_take_sdpa_and_the_faster_sdpa_baseline(tmp_path):
    """Each implementation's train columns over sdpa's (`*_vs_sdpa`) and over the faster of sdpa and sdpa_causal
    (`*_vs_best_sdpa`); the baselines get no ratio to themselves, and sdpa_causal has no generate row."""
    import argparse
    import csv

    from benchmarks import hf_model

    args = argparse.Namespace(parts=["train", "generate"], out=tmp_path, gen_batches=[2], left_pad_batches=[],
                              train_batch=2, seq=64, prompt_tokens=8, new_tokens=4, cache="dynamic",
                              rounds=1)
    rows = [{"impl": "sdpa", "train_eager_ms": 10.0, "train_compiled_ms": 12.0, "prefill_b2_ms": 4.0},
            {"impl": hf_model.SDPA_CAUSAL, "train_eager_ms": 11.0, "train_compiled_ms": 8.0},
            {"impl": "fsys", "train_eager_ms": 9.0, "train_compiled_ms": 6.0, "prefill_b2_ms": 2.0,
             "train_eager_ms_spread": 0.01}]
    rows[0]["train_eager_ms_spread"] = 0.02
    hf_model.write(rows, {}, args, torch.float32, 0.001)
    train = {r["impl"]: r for r in csv.DictReader(open(tmp_path / "hf_model_cpu_train.csv"))}
    assert float(train["fsys"]["train_eager_ms_vs_sdpa"]) == 0.9
    assert float(train["fsys"]["train_compiled_ms_vs_sdpa"]) == 0.5
    assert float(train["fsys"]["train_eager_ms_vs_best_sdpa"]) == 0.9      # sdpa the faster eager
    assert float(train["fsys"]["train_compiled_ms_vs_best_sdpa"]) == 0.75  # sdpa_causal the faster compiled
    assert train[hf_model.SDPA_CAUSAL]["train_compiled_ms_vs_best_sdpa"] == ""
    assert float(train["fsys"]["train_eager_ms_spread"]) == 0.01
    assert not any(k.startswith("train_eager_ms_spread_") for k in train["fsys"])  # a spread is no time to compare
    assert float(train[hf_model.SDPA_CAUSAL]["train_compiled_ms_vs_sdpa"]) == 8.0 / 12.0
    generate = [r["impl"] for r in csv.DictReader(open(tmp_path / "hf_model_cpu_generate.csv"))]
    assert generate == ["sdpa", "fsys"]
    # Only sdpa_causal's compiled step measured (sdpa's compiled one, with its materialised mask, left out): the
    # best-baseline ratio is over the one measured.
    del rows[0]["train_compiled_ms"]
    hf_model.write(rows, {}, args, torch.float32, 0.001)
    train = {r["impl"]: r for r in csv.DictReader(open(tmp_path / "hf_model_cpu_train.csv"))}
    assert float(train["fsys"]["train_compiled_ms_vs_best_sdpa"]) == 0.75
    assert "train_compiled_ms_vs_sdpa" not in train["fsys"]
    # A static cache's generation is a table of its own; the train table keeps its name.
    args.cache = "static"
    hf_model.write(rows, {}, args, torch.float32, 0.001)
    assert (tmp_path / "hf_model_cpu_generate_static.md").exists()
    assert "static cache" in (tmp_path / "hf_model_cpu_generate_static.md").read_text()


def test_hf_train_steps_are_timed_in_turns_and_their_median_kept(monkeypatch):
    """Every step is built before any is timed; each round takes them in turn, starting one later than the round
    before (no implementation always timed first or last); a step that fails keeps its error."""
    from benchmarks import hf_model

    monkeypatch.setattr(hf_model, "build", lambda impl, dtype, state: torch.nn.Linear(2, 2))
    built, timed = [], []

    def step_of(model, opt, batch, seq, compiled):
        name = (type(model).__name__, compiled, len(built))
        built.append(name)
        if len(built) == 3:
            raise RuntimeError("compile failed")
        return lambda: name

    monkeypatch.setattr(hf_model, "train_step", step_of)
    monkeypatch.setattr(hf_model, "bench_ms", lambda step, **kw: timed.append(step()) or float(len(timed)))
    results = hf_model.train_rounds(["a", "b"], ["a", "b"], torch.float32, {}, 2, 8, rounds=3)
    assert len(built) == 4 and len(timed) == 9  # three steps built (one failed), each timed three times
    first_of_round = [timed[0], timed[3], timed[6]]
    assert len(set(first_of_round)) == 3
    # Times are the call's place in the whole run: a's eager step was timed 1st, 6th and 8th.
    assert {k: v for k, v in results["a"].items() if not k.endswith("_spread")} == {"train_eager_ms": 6.0,
                                                                                   "train_compiled_ms": 4.0}
    assert results["a"]["train_eager_ms_spread"] == (8.0 - 1.0) / 6.0  # slowest less fastest, over the median
    assert results["b"]["train_compiled_ms"] == 5.0 and isinstance(results["b"]["train_eager_ms"], str)
    assert "train_eager_ms_spread" not in results["b"]


def test_the_backward_timed_alone_writes_its_gradients_afresh_as_forward_and_backward_does(monkeypatch):
    """Each timed call of the retained graph's backward leaves the same gradients, as each forward + backward does:
    adding them up would time one extra add kernel per input that no training step runs."""
    import benchmarks.attention as attention

    leaves, grads_after_each_call = [], []

    def fn(q, k, v, causal):
        leaves.append(q)
        return q.mul(2) + k + v

    def twice(call, rep):
        for _ in range(2):
            call()
            grads_after_each_call.append(None if leaves[0].grad is None else leaves[0].grad.clone())
        return 1.0

    monkeypatch.setattr(attention, "bench_ms", twice)
    attention.measure(fn, 1, 2, 8, 4, torch.float32, True, 1)
    backward_alone = grads_after_each_call[2:4]  # after the forward alone's two calls
    assert backward_alone[0] is not None and torch.equal(backward_alone[0], backward_alone[1])


@pytest.mark.skipif(not torch.cuda.is_available(), reason="times a GPU kernel of known length")
def test_warm_l2_ms_times_the_gpu_not_the_host_that_issues_the_calls():
    import time

    from benchmarks.harness import bench_ms, warm_l2_ms

    def sleep() -> None:  # a kernel that spins a fixed number of cycles and reads no memory
        torch.cuda._sleep(200_000)

    def slow_to_issue() -> None:  # the same kernel behind 1 ms of host time, several times the kernel's own
        time.sleep(1e-3)
        sleep()

    alone, warm = bench_ms(sleep, rep_ms=50), warm_l2_ms(sleep, rep_ms=50)
    assert 0.8 < warm / alone < 1.2, (warm, alone)
    slow = warm_l2_ms(slow_to_issue, rep_ms=50)
    assert 0.8 < slow / alone < 1.2 and slow < 0.5, (slow, alone)



def _env(date: str, command: str) -> dict:
    return {"device": "GPU X", "date": date, "command": command}


def _shown(md: str) -> list[str]:
    """The lines a Markdown viewer shows (the record of the runs is an HTML comment)."""
    return [line for line in md.splitlines() if not line.startswith("<!--")]


def test_runs_written_into_one_table_keep_each_runs_rows_header_and_notes(tmp_path):
    """`write_table(run=...)`: each run's rows under a `run` column, kept when the next run is written (their values
    read back from the CSV as numbers, so the Markdown formats them as before), an entry of the environment listed
    once where the runs agree and run by run where they differ (a command's `--` kept through the record of the
    runs), a note all runs share written once and the others under their run's label; a run written again replaces
    its own rows where they stood."""
    from benchmarks.harness import write_table

    def rows(ms):
        return [{"impl": "a", "seq_len": 1024, "causal": True, "ms": ms},
                {"impl": "b", "seq_len": 1024, "causal": True, "ms": None}]

    write_table(rows(1.23456), tmp_path, "t", "T", ["shared", "only A"], _env("d1", "x --rounds 2"), run="A")
    path = write_table(rows(2.5), tmp_path, "t", "T", ["shared"], _env("d2", "x --rounds 3"), run="B")
    md = path.read_text()
    assert "- device: GPU X\n" in md
    assert "- date:\n  - run A: d1\n  - run B: d2\n" in md
    assert "  - run A: `x --rounds 2`\n  - run B: `x --rounds 3`\n" in md
    shown = _shown(md)
    assert shown.count("shared") == 1 and "Run A: only A" in shown
    assert [line for line in shown if line.startswith("| ")] == [
        "| run | impl | seq_len | causal | ms |", "| A | a | 1024 | True | 1.235 |", "| A | b | 1024 | True | — |",
        "| B | a | 1024 | True | 2.500 |", "| B | b | 1024 | True | — |"]

    write_table(rows(9.0), tmp_path, "t", "T", ["shared"], _env("d3", "x --rounds 4"), run="A")
    md = path.read_text()
    assert [line for line in _shown(md) if line.startswith("| ")][1:] == [
        "| A | a | 1024 | True | 9.000 |", "| A | b | 1024 | True | — |",
        "| B | a | 1024 | True | 2.500 |", "| B | b | 1024 | True | — |"]
    assert "  - run A: d3\n  - run B: d2\n" in md and "only A" not in md
    csv_rows = (tmp_path / "t.csv").read_text().splitlines()
    assert csv_rows[0] == "run,impl,seq_len,causal,ms" and len(csv_rows) == 5


def test_a_run_is_not_added_to_a_table_of_one_run_nor_given_an_empty_label(tmp_path):
    """A table written without --run records no runs: adding one would drop its rows, so the suite refuses before it
    measures anything (the table is left as it was); an empty label is refused by name; a table of runs whose CSV
    (their rows) is gone is refused by the file's name."""
    from benchmarks.harness import write_table

    write_table([{"impl": "a", "ms": 1.0}], tmp_path, "attention_cpu", "T", [], _env("d1", "x"))
    before = (tmp_path / "attention_cpu.md").read_text()
    for run, message in (("B", "holds a table of one run"), ("", "label cannot be empty")):
        result = _run("attention", "--out", str(tmp_path), "--run", run, "--seq-lens", "32", "--head-dims", "16",
                      "--impls", "sdpa-math", "--no-progress")
        assert result.returncode == 2 and message in result.stderr
    assert (tmp_path / "attention_cpu.md").read_text() == before

    write_table([{"impl": "a", "ms": 1.0}], tmp_path, "runs", "T", [], _env("d1", "x"), run="A")
    (tmp_path / "runs.csv").unlink()
    with pytest.raises(ValueError, match="runs.csv, which is missing"):
        write_table([{"impl": "a", "ms": 2.0}], tmp_path, "runs", "T", [], _env("d2", "x"), run="B")
