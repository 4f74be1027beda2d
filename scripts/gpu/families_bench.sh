#!/usr/bin/env bash
# The families the cookbook defaults to (Qwen3.5) and Tinker serves (gpt-oss), trained by loraplane's torch backend
# against the HF + PEFT loop on one GPU, side by side in one process (bench/trainer_vs_peft.py; issues 32, 33).
# Both sides train rank-32 LoRA on every target the family offers (Qwen3.5: attention, the Gated DeltaNet
# projections, the MLP; gpt-oss: q/k/v/o and the experts). Gated DeltaNet runs on transformers' torch fallback on
# both sides (fla refuses this image's Triton 3.6 on Hopper).
#   bash scripts/gpu/families_bench.sh [CASE ...]   default: q9b-2048 q9b-512 oss-2048 oss-512; also q35-peft q35-ours
# Needs .gpuwh/megatron and .gpuwh/tvp_extra (bench_env.sh; build them with the shared build-wheelhouse.sh).
set -uo pipefail
. "$(dirname "$0")/bench_env.sh" families
{ nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
  python3 -c "import sys, torch, transformers, peft; print(sys.version.split()[0], torch.__version__, 'transformers', transformers.__version__, 'peft', peft.__version__)"
  git log -1 --format='%h %s' 2>/dev/null || true
} 2>&1 | tee -a "$OUT/env.log"
run_case() {  # label, then bench args
  local label=$1; shift
  echo "== $label: $*" | summary
  timeout -k 10 "${CASE_TIMEOUT:-280}" python3 bench/trainer_vs_peft.py --backend torch --tenants 1 --modes direct \
    --rank 32 --out "$OUT/$label.json" "$@" > "$OUT/$label.log" 2>&1
  local rc=$?
  grep -v -i -E "warn|^\s*$" "$OUT/$label.log" | tail -8 | summary
  [ $rc -eq 0 ] || echo "exit code $rc" | summary
  finish
}
for c in ${*:-q9b-2048 q9b-512 oss-2048 oss-512}; do
  case "$c" in
    q9b-2048) run_case qwen3.5-9b_8x2048 --shape qwen3.5-9b --datums 8 --seq-len 2048 --peft-checkpointing on --rounds 3 --warmup 1 ;;
    q9b-512) run_case qwen3.5-9b_8x512 --shape qwen3.5-9b --datums 8 --seq-len 512 --peft-checkpointing on --rounds 4 --warmup 1 --profile "$OUT" ;;
    oss-2048) run_case gpt-oss-20b_8x2048 --shape gpt-oss-20b --datums 8 --seq-len 2048 --peft-checkpointing on --rounds 3 --warmup 1 ;;
    oss-512) run_case gpt-oss-20b_8x512 --shape gpt-oss-20b --datums 8 --seq-len 512 --peft-checkpointing on --rounds 4 --warmup 1 --profile "$OUT" ;;
    # Qwen3.5-35B-A3B (70 GB in bf16): two copies do not fit one H200, so each contender runs in its own process.
    q35-peft) run_case qwen3.5-35b-a3b_8x512_peft_alone --shape qwen3.5-35b-a3b --datums 8 --seq-len 512 --tenants "" --peft-checkpointing on --rounds 3 --warmup 1 ;;
    q35-ours) run_case qwen3.5-35b-a3b_8x512_torch_alone --shape qwen3.5-35b-a3b --datums 8 --seq-len 512 --no-peft --rounds 3 --warmup 1 ;;
    *) echo "unknown case $c" | summary ;;
  esac
done
