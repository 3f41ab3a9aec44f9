"""A Hugging Face Llama-architecture model (about 1.1B parameters, TinyLlama's shape, random weights) with
`attn_implementation` flashsys against sdpa (and flex_attention), in one run:

- train: one AdamW step on batch x seq tokens (forward, backward, step), eager and torch.compile'd; every step is
  built first, then all are timed in --rounds rounds that take them in turn; the median ms over the rounds;
- generate: greedy generation of --new-tokens after a --prompt-tokens prompt, at each --gen-batches, eager with
  transformers' dynamic cache (--cache static: the static cache, whose decoding step transformers compiles on a
  GPU); decode tokens/s (new tokens x batch over the time after the prefill); at each --left-pad-batches also a
  left-padded batch (row b's prompt starts after b / batch of half the prompt as padding).

Each part (--parts train generate) writes its own table, every implementation beside sdpa in the same process; the
two parts can run at once on two GPUs.

`sdpa_causal` (training only) is transformers' sdpa attention called as its eager training step calls it, with
`is_causal=True` and no mask. Under torch.compile transformers hands `sdpa` a materialised (B, 1, N, N) causal mask
instead (its check for packed rows in `position_ids` cannot run while tracing), and SDPA then runs a masked kernel:
`sdpa_causal` is the strongest SDPA baseline for a compiled step, exact for the train part's whole, unpadded rows.

    python -m benchmarks.hf_model
    CUDA_VISIBLE_DEVICES=0 python -m benchmarks.hf_model --parts train & \
    CUDA_VISIBLE_DEVICES=1 python -m benchmarks.hf_model --parts generate
"""

from __future__ import annotations

import argparse
import copy
import statistics
import time

import torch

from benchmarks.harness import (
    DEVICE, ON_GPU, add_common_args, bench_ms, environment, run_cell, sync, write_table,
)
from flashsys.timing import round_order

SHAPES = {  # TinyLlama-1.1B's shape on a GPU; a toy one on a CPU
    True: dict(hidden_size=2048, intermediate_size=5632, num_hidden_layers=22, num_attention_heads=32,
               num_key_value_heads=4, vocab_size=32000, max_position_embeddings=8192),
    False: dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, vocab_size=256, max_position_embeddings=256),
}


PREFILL_CALLS = 3  # the prefill's time: the median of this many generate(max_new_tokens=1) calls
SDPA_CAUSAL = "sdpa_causal"  # a training-only baseline: see the module's docstring


def sdpa_causal_attention(sdpa_attention_forward):
    """transformers' sdpa attention (`sdpa_attention_forward`) called with `is_causal=True` and no mask, for whole
    unpadded training rows (queries and keys the same positions): whatever mask transformers built is dropped, so
    anything else is refused."""

    def attention(module, query, key, value, attention_mask, **kwargs):
        if query.shape[2] != key.shape[2]:
            raise ValueError(f"{SDPA_CAUSAL}: for training rows only (queries and keys at the same positions); got "
                             f"{query.shape[2]} queries over {key.shape[2]} keys (a KV cache)")
        kwargs.pop("is_causal", None)
        return sdpa_attention_forward(module, query, key, value, None, is_causal=True, **kwargs)

    return attention


def register_sdpa_causal() -> str:
    """Make `attn_implementation="sdpa_causal"` available (its mask function builds no mask). Returns the name."""
    from transformers import AttentionInterface
    from transformers.integrations.sdpa_attention import sdpa_attention_forward
    from transformers.masking_utils import AttentionMaskInterface

    AttentionInterface.register(SDPA_CAUSAL, sdpa_causal_attention(sdpa_attention_forward))
    AttentionMaskInterface.register(SDPA_CAUSAL, lambda *args, **kwargs: None)
    return SDPA_CAUSAL


def build(implementation: str, dtype: torch.dtype, state: dict | None):
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(**SHAPES[ON_GPU], attention_dropout=0.0)
    torch.manual_seed(0)
    model = LlamaForCausalLM._from_config(copy.deepcopy(config), attn_implementation=implementation,
                                          dtype=dtype).to(DEVICE)
    if state is not None:
        model.load_state_dict(state)
    return model


def train_step(model, opt, batch: int, seq: int, compiled: bool):
    """One training step of `model` (eager or torch.compile'd) with optimizer `opt`, warmed up: compiled,
    autotuned, the optimizer's state allocated."""
    model.train()
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, model.config.vocab_size, (batch, seq), generator=g).to(DEVICE)
    forward = torch.compile(model) if compiled else model

    def step():
        opt.zero_grad(set_to_none=True)
        forward(input_ids=ids, labels=ids, use_cache=False).loss.backward()
        opt.step()

    for _ in range(2):
        step()
    return step


def train_rounds(impls: list[str], compiled_impls: list[str], dtype: torch.dtype, state: dict, batch: int,
                 seq: int, rounds: int) -> dict[str, dict]:
    """{impl: {"train_eager_ms": ..., "train_compiled_ms": ..., and each one's "_spread"}}: every implementation's
    steps built first, then timed in `rounds` rounds that take the steps in turn, each round starting one step later;
    the median over the rounds, and their spread (slowest less fastest, over the median: how far a ratio of two
    medians can be trusted). Why: a GPU held at its power cap slows as it warms, and one implementation timed after
    the other pays for it (timed one after the other, the same sdpa kernels read 1.2% apart). A cell that fails
    holds its error."""
    steps, results = {}, {impl: {} for impl in impls}
    for impl in impls:
        model = build(impl, dtype, state)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-5, fused=ON_GPU)  # one per model: eager and compiled
        for compiled in (False, True):
            if compiled and impl not in compiled_impls:
                continue
            key = f"train_{'compiled' if compiled else 'eager'}_ms"
            cell = run_cell(lambda c=compiled: {"step": train_step(model, opt, batch, seq, c)})
            if "step" in cell:
                steps[(impl, key)] = cell["step"]
            else:
                results[impl][key] = cell["error"]
    times = {cell: [] for cell in steps}
    order = list(steps)
    for r in range(rounds):
        for cell in round_order(order, r):
            timed = run_cell(lambda c=cell: {"ms": bench_ms(steps[c], rep_ms=400, warmup_ms=0)})
            if "ms" in timed:
                times[cell].append(timed["ms"])
            else:
                results[cell[0]][cell[1]] = timed["error"]
    for (impl, key), ms in times.items():
        if ms and key not in results[impl]:
            results[impl][key] = statistics.median(ms)
            results[impl][f"{key}_spread"] = (max(ms) - min(ms)) / results[impl][key]
    return results


def decode_tokens_per_s(model, batch: int, prompt: int, new: int, left_pad: bool = False,
                        cache: str = "dynamic") -> dict:
    model.eval()
    g = torch.Generator().manual_seed(2)
    ids = torch.randint(1, model.config.vocab_size, (batch, prompt), generator=g).to(DEVICE)
    kwargs = dict(do_sample=False, pad_token_id=0, eos_token_id=None, cache_implementation=cache)
    if left_pad:
        pads = torch.arange(batch, device=DEVICE) * prompt // (2 * batch)
        mask = torch.arange(prompt, device=DEVICE) >= pads[:, None]
        ids = ids.masked_fill(~mask, 0)
        kwargs["attention_mask"] = mask.long()
    # Warm-up. A static cache is sized for the prompt and the new tokens, and the compiled decoding step is
    # specialised to its size: the warm-up generates as many tokens as the timed run, or that run would compile.
    warm = new if cache == "static" else 4
    with torch.no_grad():
        model.generate(ids, max_new_tokens=warm, min_new_tokens=warm, **kwargs)
        prefills = []
        for _ in range(PREFILL_CALLS):  # one call is a noisy sample of a step this short
            sync()
            start = time.perf_counter()
            model.generate(ids, max_new_tokens=1, min_new_tokens=1, **kwargs)
            sync()
            prefills.append(time.perf_counter() - start)
        prefill_s = statistics.median(prefills)
        start = time.perf_counter()
        out = model.generate(ids, max_new_tokens=new, min_new_tokens=new, **kwargs)
        sync()
        total_s = time.perf_counter() - start
    decode_s = max(total_s - prefill_s, 1e-9)
    return {"prefill_ms": prefill_s * 1e3, "decode_tok_per_s": (new - 1) * batch / decode_s,
            "tokens": out[:, prompt:].cpu()}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_common_args(p, "hf_model")
    p.add_argument("--parts", nargs="+", choices=["train", "generate"], default=["train", "generate"],
                   help="what to measure; each part writes its own table (run them on two GPUs at once if you like)")
    p.add_argument("--impls", nargs="+",
                   default=["sdpa", SDPA_CAUSAL, "fsys", "flex_attention"] if ON_GPU else ["sdpa", SDPA_CAUSAL, "fsys"],
                   help=f"attention implementations; {SDPA_CAUSAL} is timed in the train part only")
    p.add_argument("--train-batch", type=int, default=2)
    p.add_argument("--seq", type=int, default=4096 if ON_GPU else 64)
    p.add_argument("--rounds", type=int, default=3 if ON_GPU else 1,
                   help="rounds of the training steps, taken in turns (the median over rounds)")
    p.add_argument("--compiled-impls", nargs="*",
                   default=["fsys", SDPA_CAUSAL, "flex_attention"] if ON_GPU else [],
                   help="implementations whose compiled training step is timed (compiling takes minutes; plain sdpa "
                        "compiled runs a materialised mask, slower than sdpa_causal: add it to see)")
    p.add_argument("--prompt-tokens", type=int, default=2048 if ON_GPU else 32)
    p.add_argument("--new-tokens", type=int, default=256 if ON_GPU else 8)
    p.add_argument("--gen-batches", nargs="+", type=int, default=[1, 16] if ON_GPU else [2])
    p.add_argument("--cache", choices=["dynamic", "static"], default="dynamic",
                   help="generate's KV cache: static is the one transformers compiles the decoding step for "
                        "(torch.compile, CUDA graphs) on a GPU")
    p.add_argument("--left-pad-batches", nargs="*", type=int, default=[16] if ON_GPU else [2],
                   help="batches also generated left-padded (row b: b / batch of half the prompt is padding)")
    args = p.parse_args(argv)
    from flashsys.integrations.transformers import register

    register()
    register_sdpa_causal()
    dtype = torch.bfloat16 if ON_GPU else torch.float32
    state = build("sdpa", dtype, None).state_dict()
    n_params = sum(t.numel() for t in state.values()) / 1e9
    rows = [{"impl": impl} for impl in args.impls]
    tokens, paths = {}, []
    if "train" in args.parts:
        trained = train_rounds(args.impls, args.compiled_impls, dtype, state, args.train_batch, args.seq, args.rounds)
        for row in rows:
            row.update(trained[row["impl"]])
        if ON_GPU:
            torch.cuda.empty_cache()
        paths = write(rows, tokens, args, dtype, n_params)
    for row in rows if "generate" in args.parts else ():
        impl = row["impl"]
        if impl == SDPA_CAUSAL:
            continue
        model = build(impl, dtype, state)
        for batch, pad, label in _generate_cells(args):
            cell = run_cell(lambda b=batch, p=pad: decode_tokens_per_s(model, b, args.prompt_tokens, args.new_tokens,
                                                                       p, args.cache))
            row[f"prefill_{label}_ms"] = cell.get("prefill_ms", cell.get("error"))
            row[f"decode_{label}_tok_s"] = cell.get("decode_tok_per_s")
            if "tokens" in cell:
                tokens[(impl, label)] = cell["tokens"]
        model = None
        if ON_GPU:
            torch.cuda.empty_cache()
        paths = write(rows, tokens, args, dtype, n_params)  # after each: a run cut short keeps what it measured
    for path in paths:
        print(path.read_text())
    return 0


def _generate_cells(args) -> list[tuple[int, bool, str]]:
    """(batch, left-padded, the label of its columns) of each generation cell."""
    return ([(b, False, f"b{b}") for b in args.gen_batches]
            + [(b, True, f"b{b}_leftpad") for b in args.left_pad_batches])


def write(rows: list[dict], tokens: dict, args, dtype: torch.dtype, n_params: float) -> list:
    """One table per part measured (`hf_model_<device>_train`, `..._generate`) of the rows so far, with each
    implementation's ratios to sdpa's row of the same run."""
    base = next((r for r in rows if r["impl"] == "sdpa"), None)
    baselines = [r for r in rows if r["impl"] in ("sdpa", SDPA_CAUSAL)]
    out = []
    for r in rows:
        r = dict(r)
        for key, value in list(r.items()) if r["impl"] != "sdpa" else ():
            if key.endswith("_spread"):
                continue
            refs = [b[key] for b in baselines if isinstance(b.get(key), float)]
            if not isinstance(value, float) or not refs:
                continue
            if base is not None and isinstance(base.get(key), float):
                r[f"{key}_vs_sdpa"] = value / base[key]
            if key.startswith("train_") and r["impl"] != SDPA_CAUSAL:
                r[f"{key}_vs_best_sdpa"] = value / min(refs)
        for _, _, label in _generate_cells(args):
            if (r["impl"], label) in tokens and ("sdpa", label) in tokens and r["impl"] != "sdpa":
                same = tokens[(r["impl"], label)] == tokens[("sdpa", label)]
                r[f"same_tokens_{label}"] = same.float().mean().item()
        out.append(r)
    model = f"{n_params:.2f}B parameters ({SHAPES[ON_GPU]}), random weights, {str(dtype)[6:]}."
    notes = {
        "train": f"Train: batch {args.train_batch} x {args.seq} tokens, one AdamW step (forward, backward, step), "
                 f"eager and torch.compile'd, median ms per step over {args.rounds} rounds that take the steps in "
                 "turn (*_spread: the slowest round less the fastest, over the median; *_vs_sdpa: < 1 is faster; "
                 "*_vs_best_sdpa: over the "
                 f"faster of sdpa and {SDPA_CAUSAL} (of those measured), transformers' sdpa attention with is_causal=True and no mask, "
                 "which is what its eager step runs and its compiled step does not: under torch.compile transformers "
                 "hands sdpa a materialised causal mask).",
        "generate": f"Generate: greedy, {args.prompt_tokens}-token prompt, {args.new_tokens} new tokens, "
                    + ("dynamic cache, eager" if args.cache == "dynamic" else
                       "static cache (transformers compiles the decoding step: torch.compile, CUDA graphs)")
                    + " (_leftpad: row b's prompt starts after b / batch of half the prompt as "
                    f"padding, with its attention mask); prefill ms (the median of {PREFILL_CALLS} calls) and decode "
                    "tokens/s after the prefill "
                    "(*_vs_sdpa: > 1 is faster); "
                    "same_tokens: the fraction of generated tokens equal to sdpa's (bf16 rounding can flip a "
                    "near-tie, and every token after a flip follows a different sequence: with random weights the "
                    "top two logits are close and it is low; tests/integrations compares generation exactly in "
                    "float32).",
    }
    prefixes = {"train": ("train_",), "generate": ("prefill_", "decode_", "same_tokens_")}
    import transformers

    env = {**environment(), "transformers": transformers.__version__}
    paths = []
    for part in args.parts:
        part_rows = [{k: v for k, v in r.items() if k == "impl" or k.startswith(prefixes[part])} for r in out
                     if part == "train" or r["impl"] != SDPA_CAUSAL]
        name = f"hf_model_{'gpu' if ON_GPU else 'cpu'}_{part}" + ("_static" if part == "generate" and
                                                                  args.cache == "static" else "")
        paths.append(write_table(part_rows, args.out, name, f"A Llama-architecture transformers model: {part}",
                                 [f"{model} {notes[part]}"], env))
    return paths


if __name__ == "__main__":
    raise SystemExit(main())
