#!/usr/bin/env bash
# GPU tests and benchmarks in parts that each fit one device call (10 minutes), results under $OUT.
#   bash benchmarks/device_session.sh tests kernels     # call 1: pytest -m gpu, then the loss-kernel variants
#   bash benchmarks/device_session.sh norms             # issue 2's kernel benchmarks (JSON + sweeps + graph time)
#   bash benchmarks/device_session.sh e2e-small         # call 2: bench_e2e on the 1B-class configs (e2e-overlap: overlap_ce)
#   bash benchmarks/device_session.sh e2e-wide medusa   # call 3: bench_e2e on the wide configs, bench_medusa --quick
#   bash benchmarks/device_session.sh tests medusa-trees   # pytest -m gpu, then fitted Medusa trees on the demo's heads
#   bash benchmarks/device_session.sh moe softcap lora  # the MoE layer, soft-capped attention, LoRA / QLoRA steps
#   bash benchmarks/device_session.sh softcap-sweep     # the soft-capped attention kernel's settings
#   bash benchmarks/device_session.sh softcap-spread    # bf16 soft-capped paths' gradient errors over many seeds
#   bash benchmarks/device_session.sh lora-moe          # LoRA on experts + routers, ours vs HF + PEFT (MoE widths)
#   bash benchmarks/device_session.sh lora-grid-ckpt    # LoRA grid, checkpointed half (lora-grid-nockpt: the other)
#   bash benchmarks/device_session.sh nf4               # NF4 dequantisation: Triton vs reference vs bitsandbytes
#   bash benchmarks/device_session.sh dropout lora-dropout  # LoRA dropout's products, then the step with and without
#   bash benchmarks/device_session.sh lora-profile      # where a LoRA step's time goes, ours and HF + PEFT + liger-kernel
#   bash benchmarks/device_session.sh nf4-decode        # NF4 products of a few rows, and decoding on an NF4 base
#   bash benchmarks/device_session.sh nf4-rows          # nf4_matmul at 1-8 rows, and 4 prompts decoded together on NF4
#   bash benchmarks/device_session.sh liger-tests       # Liger's loss tests on our kernels (carry .liger_tests)
# Each part logs to $OUT/<part>.log and prints its last lines; a failing part does not stop the next one.
set -o pipefail
OUT=$(realpath -m "${OUT:-device_out}")
mkdir -p "$OUT"
. benchmarks/device_env.sh

E2E_PROVIDERS=${E2E_PROVIDERS:-ours,ours_graph,ours_inbwd}
run_part() {
  case $1 in
    tests)  # the whole GPU suite: 4 workers on an H200, 2 on an 80 GiB card (the tests that hold tens of GiB share
            # one worker: tests/helpers.BIG_MEMORY). On an H100, fresh machine, 2 workers took 277 s (2026-12-06); four
            # ran out of memory (41 of 275, 2026-12-05) and one did not finish in 560 s cold. GPU_WORKERS overrides;
            # `tests tests-rerun` reruns what failed, serially, so another worker's memory shows as such
      workers=${GPU_WORKERS:-$(python3 -c "import torch
print(4 if torch.cuda.get_device_properties(0).total_memory > 100 * 2**30 else 2)")}
      # shellcheck disable=SC2086  # GPU_TESTS is a list of pytest arguments
      python3 -m pytest -m gpu -q -n "$workers" --dist loadgroup -p no:cacheprovider -rfE --durations=15 \
        ${GPU_TESTS:-tests} ;;
    tests-rerun)  # the tests that failed in this call's `tests` part, again, serially in one fresh process: with
                  # workers sharing a card a failure can be another worker's memory (reported as such, not as a pass)
      failed=$(sed -n 's/^\(FAILED\|ERROR\) \([^ ]*\).*/\2/p' "$OUT/tests.log" | sort -u)
      if [ -z "$failed" ]; then echo "no failed test to rerun"; else
        # shellcheck disable=SC2086  # one node id per word
        python3 -m pytest -m gpu -q -p no:cacheprovider -rfE $failed; fi ;;
    tests-loss)  # the loss kernels' GPU tests alone
      python3 -m pytest -m gpu -q -p no:cacheprovider tests/kernels/test_cross_entropy.py \
        tests/kernels/test_fused_linear_cross_entropy.py ;;
    liger-tests)  # Liger-Kernel's own loss tests on our kernels, every case (fetched here first: carry .liger_tests;
                  # benchmarks/tools/liger_tests_on_ours/run.py)
      python3 benchmarks/tools/liger_tests_on_ours/run.py --dir .liger_tests -- -q -rA --junitxml "$OUT/liger_tests.xml" ;;
    ce-quick)  # cross-entropy at the headline shapes with its variants and peers
      (cd benchmarks && python3 bench_cross_entropy.py --quick --out "$OUT") ;;
    kernels)  # block/warp/grid variants of the CE row kernel, and linear-CE with the overlapped CE pass
      (cd benchmarks && python3 bench_cross_entropy.py --quick --out "$OUT" &&
        python3 bench_fused_linear_cross_entropy.py --quick --out "$OUT") ;;
    ce-full)  # issue 3's full sweeps (BT 2K-32K, H 2048-8192, V 32K-256K) besides the headline shapes
      (cd benchmarks && python3 bench_cross_entropy.py --out "$OUT") ;;
    flce-quick)
      (cd benchmarks && python3 bench_fused_linear_cross_entropy.py --quick --out "$OUT") ;;
    flce-full)
      (cd benchmarks && python3 bench_fused_linear_cross_entropy.py --out "$OUT") ;;
    norms)  # issue 2's kernels, full sweeps; each provider also timed with the host hidden (busy stream; graph replay
            # for the norms and RoPE: a failed first capture at swiglu / geglu's sizes leaks enough to run out of memory)
      (cd benchmarks && for b in rms_norm layer_norm rope; do
         LIGER_BENCH_GRAPH=1 LIGER_BENCH_GPU_TIME=1 python3 bench_$b.py --out "$OUT" || echo "bench_$b failed"; done
       for b in swiglu geglu; do LIGER_BENCH_GPU_TIME=1 python3 bench_$b.py --out "$OUT" || echo "bench_$b failed"; done) ;;
    rms-norm)  # the full rms_norm / add_rms_norm sweep alone (host-bound small shapes: a lone lane)
      (cd benchmarks && LIGER_BENCH_GRAPH=1 LIGER_BENCH_GPU_TIME=1 python3 bench_rms_norm.py --out "$OUT") ;;
    layer-norm)  # the full layer_norm sweep alone, GPU time too
      (cd benchmarks && LIGER_BENCH_GPU_TIME=1 python3 bench_layer_norm.py --out "$OUT") ;;
    norms-wide)  # the 8K-16K-column backward: wide kernel variants vs the split path (kernel GPU time)
      (cd benchmarks && python3 tools/tune_norms.py --sections wide --out "$OUT") ;;
    norms-quick)  # the headline rms_norm / RoPE autograd steps (host-bound: a lone lane), GPU time and graph replay too
      (cd benchmarks && for b in rms_norm rope; do
         LIGER_BENCH_GRAPH=1 LIGER_BENCH_GPU_TIME=1 python3 bench_$b.py --quick --out "$OUT" || echo "bench_$b failed"; done) ;;
    timeline)  # what the GPU runs in one step of the CE / RoPE / rms_norm benchmarks: kernels, copies, idle gaps
      (cd benchmarks && python3 tools/gpu_timeline.py --out "$OUT") ;;
    attention)  # SDPA backends at the e2e configs' attention shapes (which one a step should ask for)
      (cd benchmarks && python3 bench_attention.py --out "$OUT") ;;
    host)  # host time per call of the small-shape autograd ops and the losses, with a cProfile of each loss call
      (cd benchmarks && python3 tools/host_overhead.py --out "$OUT") ;;
    profiles)  # issue 6: one profiled step per family (PROFILE_CONFIGS)
      python3 benchmarks/tools/profile_e2e.py --out "$OUT/profiles" --configs "${PROFILE_CONFIGS:-qwen2.5-1.5b,gemma-2b,mistral-7b-w4l,phi3-mini-w8l}" ;;
    memory)  # issue 6: what is alive at the step's peak, by allocating line (allocator history replayed)
      python3 benchmarks/tools/memory_at_peak.py --out "$OUT" --configs "${MEMORY_CONFIGS:-mistral-7b-w4l,gemma-2b}" ;;
    e2e-small)  # tied lm_heads: no forward-time head step to measure, so graph capture only
      python3 benchmarks/bench_e2e.py --out "$OUT/e2e_small" --timeout 200 --providers "${E2E_SMALL_PROVIDERS:-ours,ours_graph}" \
        --configs llama-3.2-1b,qwen2.5-1.5b,gemma-2b ;;
    e2e-overlap)  # linear-CE with its CE pass overlapped on a side stream
      LIGER_TUNE=fused_linear_cross_entropy.overlap_ce=True python3 benchmarks/bench_e2e.py \
        --out "$OUT/e2e_overlap" --timeout 200 --providers ours --configs llama-3.2-1b,qwen2.5-1.5b ;;
    e2e-capped)  # Gemma-2B's step with linear-CE's scratch capped (CAP_BYTES, default 512 MiB; the accumulator
                 # becomes grad_W), and the same configs uncapped in the same call for the comparison
      python3 benchmarks/bench_e2e.py --out "$OUT/e2e_uncapped" --timeout 200 --providers ours \
        --configs "${CAPPED_CONFIGS:-gemma-2b}"
      LIGER_TUNE=fused_linear_cross_entropy.max_scratch_bytes=${CAP_BYTES:-$((512 << 20))} python3 benchmarks/bench_e2e.py \
        --out "$OUT/e2e_capped" --timeout 200 --providers ours --configs "${CAPPED_CONFIGS:-gemma-2b}" ;;
    gemm-shapes)  # every GEMM of a step at the e2e shapes, as used and in variants (split halves, fp32 split-K)
      python3 benchmarks/bench_gemm_shapes.py --out "$OUT" ;;
    e2e-cublaslt)  # the same steps with every GEMM through cuBLASLt's heuristics (torch's env switch) instead of cuBLAS
      TORCH_BLAS_PREFER_CUBLASLT=1 python3 benchmarks/bench_e2e.py --out "$OUT/e2e_cublaslt" --timeout 200 \
        --providers ours --configs "${CUBLASLT_CONFIGS:-llama-3.2-1b,mistral-7b-w4l}" ;;
    e2e-wide)
      python3 benchmarks/bench_e2e.py --out "$OUT/e2e_wide" --timeout 200 --providers $E2E_PROVIDERS \
        --configs llama-3-8b-w8l,mistral-7b-w4l,phi3-mini-w8l ;;
    medusa)  # quick sweep: this project, with and without the optimizer step in backward, and Liger-style
      python3 benchmarks/bench_medusa.py --quick --out "$OUT" --providers liger-models,liger-models-inbwd,liger-style ;;
    medusa-decoding)  # batch-1 decoding: plain greedy vs Medusa tree steps vs HF generate, 8B and 1B shapes
      python3 benchmarks/bench_medusa_decoding.py --out "$OUT" ;;
    medusa-batched)  # several prompts at once: a graphed Medusa step vs a graphed plain step by batch size, 1B and 8B
      python3 benchmarks/bench_medusa_batched.py --out "$OUT" ;;
    medusa-trees)  # fitted Medusa trees vs the default one on the demo's trained heads (trains them first)
      python3 benchmarks/bench_medusa_trees.py --out "$OUT/trees" ;;
    e2e-families)  # the newer families against HF and HF + liger-kernel, whose MoE steps take seconds each (its runs
                   # did not finish 12 steps in 70-150 s): --budget measures those over the steps that fit in 45 s
      python3 benchmarks/bench_e2e.py --out "$OUT/e2e_families" --timeout 150 --budget 45 \
        --providers "${FAMILY_PROVIDERS:-ours,hf_liger,hf}" \
        --configs "${FAMILY_CONFIGS:-qwen3-8b-w8l,gemma2-9b-w8l,gemma3-4b-w8l,qwen3-30b-a3b-w4l,mixtral-8x7b-w2l}" ;;
    e2e-compile)  # a compiled training step next to eager ours (each compiles once: the first steps are warm-up).
                  # On an H100 (2026-12-05, torch 2.11) none finished, Inductor formatting our ops' IR into a log
                  # message (fixed since: kernels/_custom_ops.py); every worker's stacks go to
                  # $OUT/e2e_compile/logs every 60 s, to show where the time goes
      LIGER_BENCH_STACKS_EVERY=${STACKS_EVERY:-60} TORCH_LOGS=${COMPILE_LOGS:-recompiles,graph_breaks} \
        python3 benchmarks/bench_e2e.py --out "$OUT/e2e_compile" --timeout "${COMPILE_TIMEOUT:-400}" \
        --providers ours_compile,ours --configs "${COMPILE_CONFIGS:-llama-3-8b-w8l}" ;;
    moe)  # one MoE layer: ours vs transformers' grouped_mm and eager experts
      (cd benchmarks && python3 bench_moe.py --out "$OUT") ;;
    moe-unfused)  # the MoE layer's GPU tests with its one-pass kernels (gated_backward_scaled, slot_sum) switched
                  # off: the PyTorch passes kept as the bisection path still train the same
      LIGER_TUNE=gated_mlp.fuse_scaled_backward=False,slot_sum.fused=False python3 -m pytest -m gpu -q \
        -p no:cacheprovider -rfE tests/kernels/test_swiglu.py tests/kernels/test_slot_sum.py \
        tests/models/test_moe_and_qwen3_gpu.py tests/lora/test_gpu.py ;;
    softcap)  # Gemma 2's soft-capped attention: our kernel vs flex + score_mod vs uncapped SDPA vs HF's math
      (cd benchmarks && python3 bench_softcap_attention.py --out "$OUT") ;;
    softcap-spread)  # the bf16 soft-capped paths' gradient errors next to the math path's over SPREAD_SEEDS random
                     # models: the distribution test_softcap_paths_on_cuda_equal_the_math_path's bound must hold
      python3 benchmarks/tools/softcap_error_spread.py --out "$OUT/softcap_spread" --seeds "${SPREAD_SEEDS:-40}" ;;
    softcap-sweep)  # the soft-capped attention kernel's block / warp / stage settings at the same shapes
      (cd benchmarks && for tune in "" softcap_attention.fwd_block_n_wide=64 softcap_attention.fwd_block_m=128 \
          softcap_attention.num_stages=1 softcap_attention.num_stages=3 softcap_attention.bwd_block_m=64 \
          softcap_attention.num_warps_wide=4 softcap_attention.bwd_block_n_wide=64 softcap_attention.split_masked=False; do
         echo "## LIGER_TUNE=$tune"
         LIGER_TUNE=$tune python3 bench_softcap_attention.py --providers kernel --out "$OUT/softcap_sweep" \
           || echo "failed: $tune"; done) ;;
    lora)  # LoRA / QLoRA at Llama-3.1-8B, checkpointing on (HF providers build in ~2 min each; LORA_PROVIDERS to pick)
      python3 benchmarks/bench_lora.py --out "$OUT/lora" --configs "${LORA_CONFIGS:-llama-3.1-8b}" --checkpointing on \
        --providers "${LORA_PROVIDERS:-ours,ours_qlora,ours_offload,hf_peft_bnb}" ;;
    lora-grid-ckpt)  # issue 35's grid for one config at a time (LORA_CONFIGS), checkpointing on at 4 x 4096, every
                     # provider (~6 min on an H100: HF builds take 15-60 s each, 2026-12-06); one device call
      python3 benchmarks/bench_lora.py --out "$OUT/lora_ckpt" --configs "${LORA_CONFIGS:-qwen2.5-7b}" --checkpointing on \
        --providers "${LORA_PROVIDERS:-ours,ours_qlora,ours_offload,hf_peft,hf_peft_liger,hf_peft_bnb,hf_peft_bnb_liger}" ;;
    lora-grid-nockpt)  # the same grid without checkpointing at 2 x 4096 (HF + PEFT needs ~100 GiB there on an H200);
                       # a device call of its own, asked for with needs_h200: on an H100 HF + PEFT and HF + PEFT +
                       # bitsandbytes ran out of memory (2026-12-06), and a call naming nvidia-h200 may get an H100
      python3 benchmarks/bench_lora.py --out "$OUT/lora_nockpt" --configs "${LORA_CONFIGS:-qwen2.5-7b}" \
        --checkpointing off --batch 2 \
        --providers "${LORA_PROVIDERS_OFF:-ours,ours_qlora,hf_peft,hf_peft_liger,hf_peft_bnb,hf_peft_bnb_liger}" ;;
    lora-grid)  # both halves (over 10 minutes: past one device call)
      run_part lora-grid-ckpt; run_part lora-grid-nockpt ;;
    lora-longest)  # the longest batch-1 QLoRA Llama-3.1-8B sequence per provider (LONGEST_BUDGET seconds each;
                   # LORA_PROVIDERS=ours_qlora_chunks,ours_qlora_offload in a call of their own: MLP chunks; checkpoints
                   # in pinned host memory). Past 131072 tokens a step takes ~51 s on an H100 (2026-12-06) and grows as
                   # T²: LONGEST_FROM=163840 LONGEST_GROWTH=1.25 searches from there, one provider per call
      python3 benchmarks/bench_lora.py --out "$OUT/lora_longest" --longest --longest-budget "${LONGEST_BUDGET:-240}" \
        --longest-from "${LONGEST_FROM:-4096}" --longest-growth "${LONGEST_GROWTH:-2}" \
        --providers "${LORA_PROVIDERS:-ours_qlora,hf_peft_bnb_liger}" ;;
    lora-profile)  # where a LoRA step's time goes (tools/profile_e2e.py --lora): ours and HF + PEFT + liger-kernel at
                   # Llama-3.1-8B, 2 x 4096 without checkpointing (LORA_CONFIGS, LORA_PROVIDERS, LORA_DROPOUT to change)
      for provider in $(echo "${LORA_PROVIDERS:-ours,hf_peft_liger}" | tr , ' '); do
        python3 benchmarks/tools/profile_e2e.py --lora --out "$OUT/profiles" --configs "${LORA_CONFIGS:-llama-3.1-8b}" \
          --provider "$provider" --batch 2 --seq 4096 --checkpointing off --dropout "${LORA_DROPOUT:-0}"
      done ;;
    lora-dora)  # DoRA at Llama-3.1-8B, checkpointing on: ours against HF + PEFT's use_dora
      python3 benchmarks/bench_lora.py --out "$OUT/lora_dora" --configs "${LORA_CONFIGS:-llama-3.1-8b}" \
        --checkpointing on --providers ours,ours_dora,hf_peft_dora ;;
    lora-dropout)  # LoRA with dropout on the adapters' input (mask drawn from a seed in forward and backward) next
                   # to none, Llama-3.1-8B without checkpointing at 2 x 4096 (LORA_PROVIDERS to add peers)
      python3 benchmarks/bench_lora.py --out "$OUT/lora_nodropout" --configs llama-3.1-8b --checkpointing off \
        --batch 2 --providers "${LORA_PROVIDERS:-ours}"
      python3 benchmarks/bench_lora.py --out "$OUT/lora_dropout" --configs llama-3.1-8b --checkpointing off \
        --batch 2 --dropout "${LORA_DROPOUT:-0.1}" --providers "${LORA_PROVIDERS:-ours}" ;;
    dropout)  # LoRA dropout's three products with the mask drawn inside (kernels/ops/dropout_matmul.py) against the
              # two-pass path and against no dropout, and the mask alone against torch's dropout and a copy
      (cd benchmarks && python3 bench_dropout.py --out "$OUT") ;;
    nf4)  # NF4 dequantisation: the Triton kernel vs the PyTorch reference and bitsandbytes (carry .whl)
      (cd benchmarks && python3 bench_nf4.py --out "$OUT") ;;
    nf4-decode)  # decoding on an NF4 base: nf4_matmul vs dequantise + GEMM vs bf16 vs bitsandbytes (carry .whl), then
                 # batch-1 greedy decoding of Llama-3.1-8B shapes: ours bf16 / NF4 both ways, HF + bitsandbytes 4-bit
      python3 benchmarks/bench_nf4_decode.py --out "$OUT/nf4_decode" ;;
    nf4-rows)  # how many rows nf4_matmul should take (its max_rows, 1 as shipped): the products at 1-8 rows, then
               # decoding 4 prompts together on the NF4 base with nf4_matmul on and off (NF4_BATCH to change)
      python3 benchmarks/bench_nf4_decode.py --out "$OUT/nf4_rows" --rows 1,2,3,4,8 --batch "${NF4_BATCH:-4}" --no-hf ;;
    lora-moe)  # LoRA on the experts and routers: Qwen3-30B-A3B (4 layers) and Mixtral-8x7B (2 layers) widths
      python3 benchmarks/bench_lora.py --out "$OUT/lora_moe" --configs qwen3-30b-a3b-w4l,mixtral-8x7b-w2l \
        --checkpointing off --batch 4 --seq 2048 --providers "${LORA_PROVIDERS:-ours,ours_qlora,hf_peft,hf_peft_bnb}" ;;
    multi-gpu)  # issue 7, on nvidia-h200-x2; all three jobs take ~12 min, so one call runs a subset (fine-tuning
                # was measured on 2026-11-29; MULTI_GPU_JOBS=finetune for it alone)
      python3 benchmarks/multi_gpu.py --out "$OUT" --jobs "${MULTI_GPU_JOBS:-medusa-stage1,medusa-stage2}" ;;
    *) echo "unknown part $1" >&2; return 2 ;;
  esac
}

for part in "$@"; do
  start=$(date +%s)
  LIGER_BENCH_PARTIAL="$OUT/$part.partial.jsonl" run_part "$part" 2>&1 | tee "$OUT/$part.log" > /dev/null
  status=$?
  echo "=== $part: exit $status after $(( $(date +%s) - start )) s"
  tail -n 25 "$OUT/$part.log"
done
