#!/usr/bin/env bash
# One-GPU device calls. Sections run in the order given (default: all of them, which takes longer than
# one 10-minute device call; split it):
#   bash scripts/gpu_bench_single.sh tests                # a call of its own: ~9 minutes on a fresh H100 (cold caches)
#   bash scripts/gpu_bench_single.sh leaderboard attention
#   bash scripts/gpu_bench_single.sh attention_check      # two check sweeps in a row, one table (~350 s on an H100)
#   bash scripts/gpu_bench_single.sh end_to_end attention_long attention_b1
#   bash scripts/gpu_bench_single.sh attention_small attention_compiled attention_short
#   bash scripts/gpu_bench_single.sh host_cost mfu attention_features     # host cost, MFU, GQA/window/varlen
#   E2E_PRESETS=small bash scripts/gpu_bench_single.sh end_to_end_compare   # one preset per call: both presets'
#   E2E_PRESETS=medium bash scripts/gpu_bench_single.sh end_to_end_compare  # 8 cells ran past 550 s on an H100
#   FA4_HEAD_DIMS=128 bash scripts/gpu_bench_single.sh attention_fa4   # beside FlashAttention-4, both with and without determinism
#   bash scripts/gpu_bench_single.sh forward_trials       # the forward variants on trial: GPU tests, then timed (D 64)
#   bash scripts/gpu_bench_single.sh tl_tiles             # every `tl` tile at the compiled models' shape, beside cuDNN
#   bash scripts/gpu_bench_single.sh model_forwards       # every forward at the compiled models' shape, L2 cold and warm
#   NCU_MORE_IMPLS="sdpa-cudnn fa4" bash scripts/gpu_bench_single.sh ncu_forward   # forwards under Nsight Compute
#   PRESET=small CONTEXT=2048 bash scripts/gpu_bench_single.sh profile_step   # a compiled step's kernels, flash vs SDPA
#   E2E_PRESETS=small bash scripts/gpu_bench_single.sh end_to_end_compiled   # one preset a call (small: ~300 s on an H200)
#   E2E_PRESETS=medium E2E_CONTEXTS=512 bash scripts/gpu_bench_single.sh end_to_end_cudagraphs   # compiled vs CUDA graphs
#   bash scripts/gpu_bench_single.sh hf_train         # transformers' 1.1B Llama: fsys, sdpa, sdpa_causal, flex (one call)
#   bash scripts/gpu_bench_single.sh hf_generate      # its generation (a call of its own)
#   bash scripts/gpu_bench_single.sh hf_generate_static   # generation with a static cache (transformers compiles it)
set -uo pipefail
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}  # keeps what the caller put there (FA4)
nvidia-smi -L | tee "$OUT/device.txt"
sections=("$@"); [ ${#sections[@]} -eq 0 ] && sections=(tests leaderboard attention end_to_end attention_long attention_b1 attention_small attention_compiled attention_short)
for s in "${sections[@]}"; do
  case $s in
  tests)
    # -v: a run cut short by the timeout still names every test that finished
    FLASHSYS_TRITON_AUTOTUNE=0 timeout -k 10 ${TEST_TIMEOUT:-570} python3 -m pytest -n 14 -p no:cacheprovider -p no:pytest_benchmark \
      --tb=short -rf -v tests/ops tests/nn > "$OUT/pytest_gpu.log" 2>&1
    echo "pytest exit: $?"; grep -E "^(FAILED|ERROR)|^E  |passed|failed" "$OUT/pytest_gpu.log" | grep -v "^\[gw" | tail -15 ;;
  leaderboard)
    # with FA4 importable its row compiles on the first call, which a fresh machine pays for
    timeout -k 10 ${LB_TIMEOUT:-240} python3 -m benchmarks.leaderboard --out "$OUT" > "$OUT/leaderboard.log" 2>&1
    grep -E "^\| |^- (fwd|bwd)" "$OUT/leaderboard.md" ;;
  attention)  # headline: ours vs SDPA, bf16, D 64/128, constant 16k tokens per cell (~4 min: the Gluon choice
              # times each variant 3 x 100 ms on its first call)
    timeout -k 10 ${ATT_TIMEOUT:-360} python3 -m benchmarks.attention --no-progress --out "$OUT/attention" \
      --impls flash-triton sdpa-flash sdpa-cudnn --head-dims 64 128 --seq-lens 1024 2048 4096 8192 16384 32768 \
      --dtypes bf16 --causal both --rep 30 > "$OUT/attention.log" 2>&1
    echo "attention exit: $?"; grep -E "^\| flash-triton" "$OUT/attention/attention_gpu.md" | cut -d'|' -f3-7,10,13 ;;
  attention_check)  # ours against cuDNN in two sweeps back to back, each a fresh process, written as runs A and B
                    # of one table (--run): "no cell above cuDNN in two sweeps in a row" is read off it
    rm -f "$OUT/attention/attention_gpu_check".{md,csv}
    for run in A B; do
      timeout -k 10 ${ATT_TIMEOUT:-200} python3 -m benchmarks.attention --no-progress --out "$OUT/attention" \
        --name attention_gpu_check --run $run --impls flash-triton sdpa-cudnn --head-dims 64 128 \
        --seq-lens 1024 2048 4096 8192 16384 --dtypes bf16 --causal both --rep 30 > "$OUT/attention_check_$run.log" 2>&1
      echo "attention_check $run exit: $?"
    done
    grep -E "^\| [AB] \| flash-triton" "$OUT/attention/attention_gpu_check.md" | cut -d'|' -f2,5-8,11,14 ;;
  attention_long)  # the longest sequences, batch 1
    timeout -k 10 120 python3 -m benchmarks.attention --no-progress --out "$OUT/attention_long" \
      --impls flash-triton sdpa-flash sdpa-cudnn --head-dims 64 128 --seq-lens 65536 --dtypes bf16 --rep 20 \
      > "$OUT/attention_long.log" 2>&1
    echo "attention_long exit: $?"; grep -E "^\| " "$OUT/attention_long/attention_gpu.md" | cut -d'|' -f2-7,10,13 ;;
  attention_b1)  # batch 1, short sequences: where an eager op's host-side cost shows
    timeout -k 10 100 python3 -m benchmarks.attention --no-progress --out "$OUT/attention_b1" --batch 1 \
      --impls flash-triton sdpa-flash sdpa-cudnn --head-dims 64 --seq-lens 1024 2048 4096 --dtypes bf16 --causal both \
      --rep 30 > "$OUT/attention_b1.log" 2>&1
    echo "attention_b1 exit: $?"; grep -E "^\| " "$OUT/attention_b1/attention_gpu.md" | cut -d'|' -f2-10 ;;
  attention_small)  # every implementation at head dims 16 and 32, fp32 and bf16
    timeout -k 10 ${ATT_TIMEOUT:-420} python3 -m benchmarks.attention --no-progress --out "$OUT/attention_small" \
      --head-dims 16 32 --seq-lens 1024 4096 16384 --dtypes fp32 bf16 --causal yes --rep 10 \
      > "$OUT/attention_small.log" 2>&1
    echo "attention_small exit: $?"; grep -E "^\| " "$OUT/attention_small/attention_gpu.md" | cut -d'|' -f2-7,10,13 ;;
  attention_short)  # every implementation at N 128-512 (batch 128-32 at 16k tokens)
    timeout -k 10 ${ATT_TIMEOUT:-300} python3 -m benchmarks.attention --no-progress --out "$OUT/attention_short" \
      --head-dims 64 128 --seq-lens 128 256 512 --dtypes bf16 fp32 --causal yes --rep 20 \
      > "$OUT/attention_short.log" 2>&1
    echo "attention_short exit: $?"; grep -E "^\| " "$OUT/attention_short/attention_gpu.md" | cut -d'|' -f2-7,10,13,14 ;;
  attention_compiled)  # naive attention eager vs torch.compile, beside ours
    timeout -k 10 200 python3 -m benchmarks.attention --no-progress --out "$OUT/attention_compiled" \
      --impls naive naive-compiled flash-triton --head-dims 64 --seq-lens 1024 4096 --dtypes fp32 bf16 --causal yes \
      --rep 20 > "$OUT/attention_compiled.log" 2>&1
    echo "attention_compiled exit: $?"; grep -E "^\| " "$OUT/attention_compiled/attention_gpu.md" | cut -d'|' -f2-7,10,11,13 ;;
  end_to_end)
    for dt in ${E2E_DTYPES:-fp32 bf16}; do
      timeout -k 10 ${E2E_TIMEOUT:-300} python3 -m benchmarks.end_to_end --no-progress --out "$OUT/end_to_end" --dtype $dt \
        --warmup 2 --iters 5 > "$OUT/end_to_end_$dt.log" 2>&1
      echo "end_to_end $dt exit: $?"; grep -E "^\| " "$OUT/end_to_end/end_to_end_gpu_${dt}_flash_w2.md" | cut -c1-150
    done
    [ -n "${E2E_SKIP_W0:-}" ] && continue
    timeout -k 10 60 python3 -m benchmarks.end_to_end --no-progress --out "$OUT/end_to_end" --presets small medium \
      --warmup 0 --iters 5 > "$OUT/end_to_end_w0.log" 2>&1  # what skipping warm-up does
    echo "end_to_end w0 exit: $?"; grep -E "^\| " "$OUT/end_to_end/end_to_end_gpu_fp32_flash_w0.md" | cut -c1-150 ;;
  end_to_end_compare)  # flash vs SDPA inside the model, eager and compiled (the table is written per cell)
    timeout -k 10 ${E2E_TIMEOUT:-540} python3 -m benchmarks.end_to_end --no-progress --out "$OUT/end_to_end" \
      --presets ${E2E_PRESETS:-small medium} --contexts 512 2048 --dtype bf16 --attention flash sdpa \
      --modes eager compiled --warmup 3 --iters 10 > "$OUT/end_to_end_compare.log" 2>&1
    echo "end_to_end_compare exit: $?"; grep -E "^\| " "$OUT"/end_to_end/end_to_end_gpu_bf16_flash-sdpa_eager-compiled_w3.md \
      | cut -d'|' -f2-9,16 ;;
  attention_fa4)  # beside FlashAttention-4 (importable: ../shared/tools/fa4_payload.sh): flashsys and FA4 each with
                  # and without determinism, SDPA-cuDNN, on (B, N, H, D) inputs, 3 interleaved rounds; FA4_HEAD_DIMS
                  # (default 128), FA4_SEQ_LENS (default 4096 8192 16384): ~160 s a head dim on a warm H100
    dims=${FA4_HEAD_DIMS:-128}; name=attention_gpu_fa4_det_d${dims// /_}
    timeout -k 10 ${ATT_TIMEOUT:-540} python3 -m benchmarks.attention --no-progress --out "$OUT/attention" \
      --impls flash-triton flash-triton-nondet sdpa-cudnn fa4 fa4-det --layout bnhd --name $name \
      --head-dims $dims --seq-lens ${FA4_SEQ_LENS:-4096 8192 16384} --dtypes bf16 --causal both --rep 25 --rounds 3 \
      > "$OUT/attention_fa4.log" 2>&1
    echo "attention_fa4 exit: $?"; grep -E "^\| " "$OUT/attention/$name.md" | cut -d'|' -f2-6,10,13-16 ;;
  end_to_end_compiled)  # the compiled step, flash against SDPA, 3 interleaved rounds, contexts 512-8192
    timeout -k 10 ${E2E_TIMEOUT:-560} python3 -m benchmarks.end_to_end --no-progress --out "$OUT/end_to_end" \
      --presets ${E2E_PRESETS:-small} --contexts 512 2048 8192 --dtype bf16 --attention flash sdpa --modes compiled \
      --rounds 3 --warmup 3 --iters 5 > "$OUT/end_to_end_compiled.log" 2>&1
    echo "end_to_end_compiled exit: $?"; grep -E "^\| " "$OUT"/end_to_end/end_to_end_gpu_bf16_flash-sdpa_compiled_w3.md \
      | cut -d'|' -f2-9,16 ;;
  end_to_end_cudagraphs)  # the compiled step with and without CUDA graphs (mode="reduce-overhead"), flash against
                          # SDPA: where the default mode's step waits on the host (medium 512, compiled mode alone: ~270 s)
    timeout -k 10 ${E2E_TIMEOUT:-560} python3 -m benchmarks.end_to_end --no-progress --out "$OUT/end_to_end" \
      --presets ${E2E_PRESETS:-small} --contexts ${E2E_CONTEXTS:-512} --dtype bf16 --attention flash sdpa \
      --modes compiled reduce-overhead --rounds 3 --warmup 3 --iters 5 > "$OUT/end_to_end_cudagraphs.log" 2>&1
    echo "end_to_end_cudagraphs exit: $?"; grep -E "^\| " \
      "$OUT"/end_to_end/end_to_end_gpu_bf16_flash-sdpa_compiled-reduce-overhead_w3.md | cut -d'|' -f2-9,16 ;;
  forward_trials)  # the forward variants on trial (dispatch.FORWARD_TRIALS): checked against float64 on the GPU
                   # tests' masked cases, then timed beside every candidate, cuDNN and FA4 (where importable)
    FLASHSYS_TRITON_AUTOTUNE=0 timeout -k 10 ${TEST_TIMEOUT:-200} python3 -m pytest -n 8 -p no:cacheprovider \
      -p no:pytest_benchmark --tb=short -rf -q tests/ops/test_gluon_forward.py -k "matches_reference_gpu" \
      > "$OUT/pytest_forward_trials.log" 2>&1
    echo "pytest exit: $?"; grep -E "^(FAILED|ERROR)|passed|failed" "$OUT/pytest_forward_trials.log" | tail -8
    timeout -k 10 ${ATT_TIMEOUT:-300} python3 scripts/forward_variants.py --head-dims 64 --seq-lens 4096 16384 \
      --causal both --rounds 3 --rep 40 > "$OUT/forward_trials.log" 2>&1
    echo "forward_variants exit: $?"; grep -E "^D |^\| " "$OUT/forward_trials.log" ;;
  model_forwards)  # every forward, ours, cuDNN's and FA4's (where importable), at the compiled models' attention
                  # (batch 4, N 2048, D 64, causal; 12 and 16 heads), timed as GPU work with the L2 flushed (as the
                  # timed choice times) and with the inputs warm in it (as a model hands them over)
    for heads in ${FV_HEADS:-12 16}; do
      for timing in gpu warm; do
        log="$OUT/model_forwards_h${heads}_$timing.log"
        timeout -k 10 ${FV_TIMEOUT:-120} python3 scripts/forward_variants.py --head-dims 64 --seq-lens 2048 --batch 4 \
          --heads $heads --causal yes --rounds 3 --timing $timing > "$log" 2>&1
        echo "forward_variants H $heads --timing $timing exit: $?"; grep -E "^\| " "$log"
      done
    done ;;
  ncu_forward)  # forwards of NCU_CELLS side by side under Nsight Compute (NCU_IMPLS: label starts; add fa4 with FA4
                # importable), then scripts/ncu_forward.py's summary of the counters; the report and CSV pages stay
                # under $OUT/ncu (a Firecracker machine: ncu reads no counters under gVisor, docs/development.md)
    mkdir -p "$OUT/ncu"; ncu=$(command -v ncu || ls /opt/nvidia/nsight-compute/*/ncu 2>/dev/null | head -1)
    timeout -k 10 ${NCU_TIMEOUT:-420} "$ncu" --clock-control none --profile-from-start off --set full -f \
      -o "$OUT/ncu/forward" python3 scripts/ncu_forward.py run --cells ${NCU_CELLS:-64:causal:16384} \
      --impls "${NCU_IMPLS:-pingpong 192x128 2buf}" ${NCU_MORE_IMPLS:-sdpa-cudnn} --labels "$OUT/ncu/labels.txt" \
      > "$OUT/ncu/ncu.log" 2>&1
    echo "ncu exit: $?"
    for page in details raw; do "$ncu" --import "$OUT/ncu/forward.ncu-rep" --page $page --csv > "$OUT/ncu/$page.csv"; done
    "$ncu" --import "$OUT/ncu/forward.ncu-rep" --page source --csv --print-source sass > "$OUT/ncu/source.csv"
    python3 scripts/ncu_forward.py summary --labels "$OUT/ncu/labels.txt" --details "$OUT/ncu/details.csv" \
      --raw "$OUT/ncu/raw.csv" --source "$OUT/ncu/source.csv" | tee "$OUT/ncu/summary.md" ;;
  tl_tiles)  # every tile of the `tl` kernels at the compiled models' attention shape (batch 4, N 2048, D 64,
             # causal; the small preset's 12 heads, the medium's 16) beside cuDNN; TILES_EXTRA="fwd:128,64,4,2 ...";
             # TILES_L2=both times each with the L2 flushed and warm in the same rounds (twice as long: one head
             # count a call, TILES_HEADS=12 TILES_TIMEOUT=450)
    for heads in ${TILES_HEADS:-12 16}; do
      timeout -k 10 ${TILES_TIMEOUT:-240} python3 scripts/tl_tiles.py --heads $heads --tiles all --l2 ${TILES_L2:-flushed} \
        ${TILES_EXTRA:+--extra $TILES_EXTRA} --out "$OUT/tl_tiles_h$heads" > "$OUT/tl_tiles_h$heads.log" 2>&1
      echo "tl_tiles heads $heads exit: $?"; grep -E "^\| |^forward|^backward|failed" "$OUT/tl_tiles_h$heads.log"
    done ;;
  profile_step)  # where a compiled step's time goes, flashsys against SDPA: attention's kernels against the rest,
                 # host ops, graph breaks (PRESET=small CONTEXT=2048 by default)
    timeout -k 10 ${PROFILE_TIMEOUT:-300} python3 scripts/profile_lm_step.py --preset ${PRESET:-small} \
      --context ${CONTEXT:-2048} --mode compiled --attention flash sdpa --top 12 > "$OUT/profile_step.log" 2>&1
    echo "profile_step exit: $?"; grep -E "round|busy|attention kernels|us a call" "$OUT/profile_step.log" ;;
  host_cost)  # host µs per attention call vs SDPA, and where they go; "before" too when .old/ holds an older
              # tree (git archive <commit> | tar -x -C .old, carried to the device): same machine, same call
    if [ -d .old ]; then
      cp benchmarks/host_cost.py .old/benchmarks/
      (cd .old && PYTHONPATH=$PWD timeout -k 10 120 python3 -m benchmarks.host_cost --out "$OUT/host_cost" \
         --name host_cost_gpu_before > "$OUT/host_cost_before.log" 2>&1; echo "host_cost before exit: $?")
    fi
    timeout -k 10 120 python3 -m benchmarks.host_cost --out "$OUT/host_cost" --breakdown > "$OUT/host_cost.log" 2>&1
    echo "host_cost exit: $?"; grep -E "^\| " "$OUT"/host_cost/*.md ;;
  mfu)  # tokens/s and MFU of the main job on one GPU
    timeout -k 10 200 python3 -m flashsys train --preset small --context-length 1024 --dtype bfloat16 \
      --batch-size ${MFU_BATCH:-64} --steps 25 --out "$OUT/mfu_run" > "$OUT/mfu_run.log" 2>&1
    echo "mfu exit: $?"; grep -E "throughput|peak memory|loss" "$OUT/mfu_run.log" | tail -4 ;;
  attention_features)  # GQA vs SDPA enable_gqa, sliding window vs causal, varlen vs padded SDPA
    timeout -k 10 ${FEAT_TIMEOUT:-400} python3 -m benchmarks.attention_features --no-progress \
      --out "$OUT/attention_features" > "$OUT/attention_features.log" 2>&1
    echo "attention_features exit: $?"; grep -E "^\| " "$OUT/attention_features/attention_features_gpu.md" ;;
  hf_train)  # the 1.1B Llama's training step through transformers, fsys against sdpa, sdpa_causal and flex (eager),
             # and compiled for fsys, sdpa_causal and flex (HF_IMPLS to choose; compiling takes minutes a model)
    timeout -k 10 ${HF_TIMEOUT:-560} python3 -m benchmarks.hf_model --no-progress --out "$OUT/hf_model" --parts train \
      --impls ${HF_IMPLS:-sdpa sdpa_causal fsys flex_attention} > "$OUT/hf_train.log" 2>&1
    echo "hf_train exit: $?"; grep -E "^\| " "$OUT/hf_model/hf_model_gpu_train.md" ;;
  hf_generate)  # the same model's prefill and decode tokens/s (batch 1 and 16, and 16 left-padded)
    timeout -k 10 ${HF_TIMEOUT:-560} python3 -m benchmarks.hf_model --no-progress --out "$OUT/hf_model" --parts generate \
      --impls ${HF_IMPLS:-sdpa fsys flex_attention} > "$OUT/hf_generate.log" 2>&1
    echo "hf_generate exit: $?"; grep -E "^\| " "$OUT/hf_model/hf_model_gpu_generate.md" | cut -c1-400 ;;
  hf_generate_static)  # the same with a static cache: transformers compiles the decoding step (CUDA graphs)
    timeout -k 10 ${HF_TIMEOUT:-560} python3 -m benchmarks.hf_model --no-progress --out "$OUT/hf_model" --parts generate \
      --cache static --impls ${HF_IMPLS:-sdpa fsys} > "$OUT/hf_generate_static.log" 2>&1
    echo "hf_generate_static exit: $?"; grep -E "^\| " "$OUT/hf_model/hf_model_gpu_generate_static.md" | cut -c1-400 ;;
  *) echo "unknown section $s"; exit 2 ;;
  esac
done
