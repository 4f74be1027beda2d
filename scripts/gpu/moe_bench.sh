#!/usr/bin/env bash
# Qwen3-MoE LoRA training on H100s (bench/trainer_moe.py; issue 22's numbers go to docs/benchmarks.md).
#   bash scripts/gpu/moe_bench.sh [CASE ...]
#   default on 1 GPU: vs-peft trainer-alone fused     on 2 GPUs: + ep2     on 4+ GPUs: + ep2 ep4
#     vs-peft  the truncated Qwen3-30B-A3B (24 of 48 layers), 8 x 2048 tokens, rank 32 on q,k,v,o and the experts,
#              gradient checkpointing / full recomputation: transformers 5 experts_implementation="grouped_mm" +
#              PEFT target_parameters, against the trainer with a per-expert adapter (PEFT's layout), alternated
#              in one process on one GPU
#     trainer-alone  the trainer with a per-expert and with a shared-outer adapter, no PEFT in the process
#     fused    the same shape, no PEFT: 8 fused shared-outer tenants (1 datum each) against 1 tenant (8 datums; the
#              first of the 8: the same 16k tokens per step), recomputation / micro-batches as memory demands
#     ep2/ep4  the full 48 layers, experts over 2 / 4 GPUs (EP = world, TP 1), 4 x 2048 tokens per GPU ($EP_DATUMS),
#              every layer recomputed ($EP_RECOMPUTE): one
#              per-expert tenant, then fused shared-outer tenants (4 on 2 GPUs, 8 on 4) (tokens/s per GPU, MFU on
#              active params, memory per tenant slot, how many more slots fit)
#   if vs-peft runs out of memory (PEFT's fp32 logits beside the trainer's slots):
#     vs-peft-bf16  vs-peft with PEFT's loss on bf16 logits;  peft-alone  the PEFT loop by itself;
#     trainer-alone  the trainer's contenders by themselves
#     profile-alone  one profiled step of each layout, no PEFT (recompute auto; kernel families, top ops)
#     gpu-tests  tests/gpu/test_megatron_moe.py (bf16 MoE logits and expert LoRA against fp32 references)
#     dp2      the full 48 layers as replicas (EP=1, data parallel over the GPUs; what the trainer plans on H200s) on 1
#              GPU, then on 2, each layout, $EP_DATUMS x 2048 tokens per GPU
#   one call on one H100 (under 9 minutes; each case capped by its own timeout):
#     h100    vs-peft with one profiled step of each contender (kernel families into summary.log), then fused
#             (8 tenants x 1 x 2048 tokens against 1 tenant x 8 x 2048: the same 16k tokens per step, the 1-tenant
#             contender being the first of the 8), then the trainer alone (per-expert) with --recompute selective
#             (every layer's attention half recomputed, the experts' activations kept) and with --recompute auto
#             (micro-batches / layers recomputed only as memory demands), against vs-peft's full recomputation,
#             then gpu-tests
# Single-GPU cases run on GPU $GPU (default 0). A case that runs past CASE_TIMEOUT seconds (default 300) is stopped; what the others
# measured still returns. Carry .gpuwh (megatron + tvp_extra parts, wheelhouses built
# as for scripts/gpu/trainer_vs_peft.sh). JSON + logs come back in $OUT as one tar, with summary.log beside it.
set -uo pipefail
. "$(dirname "$0")/bench_env.sh" moe_bench
GPUS=$(nvidia-smi --query-gpu=index --format=csv,noheader 2>/dev/null | wc -l)
{ nvidia-smi --query-gpu=index,name,memory.total,driver_version --format=csv,noheader
  python3 -c "import sys, torch, transformers, peft; print(sys.version.split()[0], torch.__version__, torch.version.cuda, 'transformers', transformers.__version__, 'peft', peft.__version__)"
  git log -1 --format='%h %s' 2>/dev/null || true
} 2>&1 | tee -a "$OUT/env.log"
single() {  # label, then bench args: one process on GPU 0
  local label=$1; shift
  echo "== $label: $*" | summary
  CUDA_VISIBLE_DEVICES=${GPU:-0} timeout -k 10 "${CASE_TIMEOUT:-300}" python3 bench/trainer_moe.py --out "$OUT/$label.json" \
    "$@" > "$OUT/$label.log" 2>&1
  local rc=$?
  grep -v -i -E "warn|^\s*$|^RESULT" "$OUT/$label.log" | tail -10 | summary
  [ $rc -eq 0 ] || echo "exit code $rc" | summary
  finish
}
ep() {  # label nproc, then bench args: one torchrun job on the first nproc GPUs
  local label=$1 nproc=$2; shift 2
  echo "== $label: $nproc GPUs, EP=$nproc $*" | summary
  # Adapters are drawn and laid out on the host (as the trainer does): torchrun's one OpenMP thread per rank made 8
  # tenants of 48 layers take minutes (run s23).
  OMP_NUM_THREADS=$(( $(nproc) / nproc > 1 ? $(nproc) / nproc : 1 )) \
  timeout -k 10 "${CASE_TIMEOUT:-300}" torchrun --standalone --nproc-per-node "$nproc" bench/trainer_moe.py --mode ep --stack-dump-s 100 \
    --out "$OUT/$label.json" "$@" > "$OUT/$label.log" 2>&1
  local rc=$?
  grep -v -i -E "warn|^\s*$|^RESULT" "$OUT/$label.log" | grep -v "^\[rank" | tail -8 | summary
  [ $rc -eq 0 ] || echo "exit code $rc" | summary
  finish
}
gpu_tests() {  # tests/gpu/test_megatron_moe.py on GPU 0
  echo "== gpu-tests" | summary
  CUDA_VISIBLE_DEVICES=${GPU:-0} timeout -k 10 "${CASE_TIMEOUT:-300}" python3 -m pytest tests/gpu/test_megatron_moe.py -m gpu \
    -o addopts="" --noconftest -p no:cacheprovider -q -rA 2>&1 | tee -a "$OUT/gpu_tests.log" \
    | grep -E "PASSED|FAILED|ERROR|passed|failed|measured" | summary
  finish
}
default="vs-peft trainer-alone fused"
[ "$GPUS" -ge 2 ] && default="$default ep2"
[ "$GPUS" -ge 4 ] && default="$default ep4"
for c in ${*:-$default}; do
  case "$c" in
    # PEFT's layout (per expert) only: the PEFT loop's adapter state and fp32 logits leave no room for a second slot.
    vs-peft) single qwen3moe24_8x2048_vs_peft --shape qwen3-30b-a3b-24l --contenders per_expert:1 \
               --rounds ${ROUNDS:-4} --warmup 1 ;;
    # PEFT's own loss on bf16 logits (if its fp32 upcast of 16k x 152k logits runs out of memory beside the trainer).
    vs-peft-bf16) single qwen3moe24_8x2048_vs_peft_bf16loss --shape qwen3-30b-a3b-24l \
               --contenders per_expert:1 --peft-loss bf16 --rounds ${ROUNDS:-4} --warmup 1 ;;
    peft-alone) single qwen3moe24_8x2048_peft_alone --shape qwen3-30b-a3b-24l --contenders "" --rounds 3 --warmup 1 ;;
    trainer-alone) single qwen3moe24_8x2048_trainer_alone --shape qwen3-30b-a3b-24l \
               --contenders per_expert:1,shared_outer:1 --no-peft --rounds ${ROUNDS:-4} --warmup 1 ;;
    # 8 slots of 3.9 GiB beside the 31 GB base leave no room for a full pass's logits: micro-batches as memory asks.
    fused) single qwen3moe24_8x2048_fused --shape qwen3-30b-a3b-24l --contenders shared_outer:1,shared_outer:8 \
             --no-peft --recompute auto --rounds ${ROUNDS:-4} --warmup 1 ;;
    ep2|ep4) n=${c#ep}
             [ "$GPUS" -ge "$n" ] || { echo "== $c: needs $n GPUs, this machine has $GPUS" | summary; continue; }
             # 4 x 2048 tokens per GPU with every layer recomputed: the automatic plan for 8 x 2048 ran out of memory
             # at EP=2 (run s23: it does not count the all-to-all's buffers).
             ep qwen3moe48_ep${n}_per_expert_1t "$n" --shape qwen3-30b-a3b --contenders per_expert:1 \
               --datums ${EP_DATUMS:-4} --recompute ${EP_RECOMPUTE:-full} --rounds ${ROUNDS:-3} --warmup 1
             ep qwen3moe48_ep${n}_shared_outer_$((2 * n))t "$n" --shape qwen3-30b-a3b --contenders shared_outer:$((2 * n)) \
               --datums ${EP_DATUMS:-4} --recompute ${EP_RECOMPUTE:-full} --rounds ${ROUNDS:-3} --warmup 1 ;;
    # What the trainer's parallel plan picks for Qwen3-30B-A3B on H200s (it fits one: replicas, EP=1) against one
    # GPU at equal tokens per GPU: one torchrun job on 1 GPU, then on 2 (data parallel, every rank the whole model).
    dp2) for layout in shared_outer per_expert; do
           ep qwen3moe48_one_gpu_${layout} 1 --shape qwen3-30b-a3b --ep 1 --contenders $layout:1 \
             --datums ${EP_DATUMS:-4} --recompute ${EP_RECOMPUTE:-full} --rounds ${ROUNDS:-3} --warmup 1
           [ "$GPUS" -ge 2 ] && ep qwen3moe48_dp2_${layout} 2 --shape qwen3-30b-a3b --ep 1 --contenders $layout:1 \
             --datums ${EP_DATUMS:-4} --recompute ${EP_RECOMPUTE:-full} --rounds ${ROUNDS:-3} --warmup 1
         done ;;
    h100) CASE_TIMEOUT=170 single qwen3moe24_8x2048_vs_peft --shape qwen3-30b-a3b-24l --contenders per_expert:1 \
            --rounds ${ROUNDS:-3} --warmup 1 --profile "$OUT/profile"
          for f in "$OUT"/profile/profile_*.txt; do
            [ -f "$f" ] && { echo "-- $(basename "$f")"; head -8 "$f"; } | summary
          done
          CASE_TIMEOUT=120 single qwen3moe24_8x2048_fused --shape qwen3-30b-a3b-24l \
            --contenders shared_outer:1,shared_outer:8 --no-peft --recompute auto --rounds ${ROUNDS:-3} --warmup 1
          CASE_TIMEOUT=80 single qwen3moe24_8x2048_trainer_recompute_selective --shape qwen3-30b-a3b-24l \
            --contenders per_expert:1 --no-peft --recompute selective --rounds ${ROUNDS:-3} --warmup 1
          CASE_TIMEOUT=70 single qwen3moe24_8x2048_trainer_recompute_auto --shape qwen3-30b-a3b-24l \
            --contenders per_expert:1 --no-peft --recompute auto --rounds ${ROUNDS:-3} --warmup 1
          CASE_TIMEOUT=90 gpu_tests ;;
    # One profiled step of each layout by itself (no PEFT in the process: the profiled vs-peft case runs out of memory).
    profile-alone) CASE_TIMEOUT=${CASE_TIMEOUT:-240} single qwen3moe24_8x2048_trainer_profile --shape qwen3-30b-a3b-24l \
                     --contenders per_expert:1,shared_outer:1 --no-peft --recompute auto --rounds 2 --warmup 1 \
                     --profile "$OUT/profile"
                   for f in "$OUT"/profile/profile_*.txt; do
                     [ -f "$f" ] && { echo "-- $(basename "$f")"; head -40 "$f"; } | summary
                   done ;;
    gpu-tests) gpu_tests ;;
    *) echo "unknown case $c" | summary ;;
  esac
done
