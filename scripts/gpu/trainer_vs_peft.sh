#!/usr/bin/env bash
# The trainer-vs-PEFT benchmark on one GPU (bench/trainer_vs_peft.py; numbers go to docs/benchmarks.md).
#   bash scripts/gpu/trainer_vs_peft.sh [CASE ...]     default: 1b 8b 8b-long-bf16 8b-long-peft; the others: 1b-unfused (before/after),
#     8b-long-bf16 / 8b-long-peft / 8b-long-alone (16 x 2048 variants), 1b-profile, 8b-profile, tests (tests/gpu/test_megatron_fast_paths.py, test_megatron_families.py),
#     1b-fusion / 8b-fusion (the compiled RoPE and SwiGLU chains off, then on: LORAPLANE_MEGATRON_COMPILE)
# A case that runs longer than CASE_TIMEOUT seconds (default 480) is stopped; what the others measured still returns.
# Needs megatron-core's wheel parts in .gpuwh/megatron/parts and the few pure-Python packages of
# scripts/gpu/trainer_vs_peft-wheels.txt in .gpuwh/tvp_extra/parts (each a wheelhouse: `pip download --no-deps
# --only-binary=:all: --python-version 3.12` of the list, tarred and split into parts; carry them with the call). JSON + a summary log land in $OUT.
set -uo pipefail
. "$(dirname "$0")/bench_env.sh" trainer_vs_peft
{ nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
  python3 -c "import sys, torch, transformers, peft; print(sys.version.split()[0], torch.__version__, torch.version.cuda, 'transformers', transformers.__version__, 'peft', peft.__version__)"
  git log -1 --format='%h %s' 2>/dev/null || true
} 2>&1 | tee -a "$OUT/env.log"
run_case() {  # label, then bench args; $COMPILE: LORAPLANE_MEGATRON_COMPILE for this case (default: all parts)
  local label=$1; shift
  echo "== $label: LORAPLANE_MEGATRON_COMPILE=${COMPILE:-1} $*" | tee -a "$OUT/summary.log"
  LORAPLANE_MEGATRON_COMPILE=${COMPILE:-1} timeout -k 10 "${CASE_TIMEOUT:-480}" \
    python3 bench/trainer_vs_peft.py --out "$OUT/$label.json" "$@" > "$OUT/$label.log" 2>&1
  local rc=$?
  grep -v -i -E "warn|^\s*$" "$OUT/$label.log" | tail -12 | tee -a "$OUT/summary.log"
  [ $rc -eq 0 ] || echo "exit code $rc" | tee -a "$OUT/summary.log"
  finish  # a later case that runs out the call's time still leaves this one's results
}
cases=${*:-1b 8b 8b-long-bf16 8b-long-peft}
for c in $cases; do
  case "$c" in
    1b) run_case llama1b_16x512 --shape llama1b --datums 16 --seq-len 512 --tenants 1,8 --rounds ${ROUNDS:-10} ;;
    8b) run_case llama8b_4x512 --shape llama8b --datums 4 --seq-len 512 --tenants 1,4 --rounds ${ROUNDS:-10} ;;
    8b-long) run_case llama8b_16x2048 --shape llama8b --datums 16 --seq-len 2048 --tenants 1,8 --rounds ${ROUNDS:-4} --warmup 1 ;;
    # The PEFT loop's fp32 logits (32k x 128k) do not fit: a user drops the upcast.
    8b-long-bf16) run_case llama8b_16x2048_peftbf16 --shape llama8b --datums 16 --seq-len 2048 --tenants 1,8 --rounds ${ROUNDS:-4} --warmup 1 --peft-loss bf16 ;;
    # PEFT alone (no second copy of the weights in the process): does the user's loop fit by itself?
    8b-long-peft) run_case llama8b_16x2048_peft_alone --shape llama8b --datums 16 --seq-len 2048 --tenants "" --rounds 3 --warmup 1 --peft-loss ${PEFT_LOSS:-bf16} ;;
    # The backend alone (its HF source moved off the device, as in a deployment): how many layers recompute=auto picks.
    8b-long-alone) run_case llama8b_16x2048_megatron_alone --shape llama8b --datums 16 --seq-len 2048 --tenants 1,8 --rounds 3 --warmup 1 --no-peft ;;
    1b-profile) run_case llama1b_16x512_profile --shape llama1b --datums 16 --seq-len 512 --tenants 1 --rounds 3 --profile "$OUT" ;;
    # Where an 8B 16 x 2048 step's time goes (issue 11's MFU miss): kernel families and device-busy share.
    8b-profile) run_case llama8b_16x2048_profile --shape llama8b --datums 16 --seq-len 2048 --tenants 1 --rounds 2 --warmup 1 --no-peft --profile "$OUT" ;;
    # Before/after in one run on the same machine: megatron's unfused attention without recomputation.
    1b-unfused) run_case llama1b_16x512_unfused --shape llama1b --datums 16 --seq-len 512 --tenants 1,8 --rounds ${ROUNDS:-10} --attention unfused --recompute none ;;
    # Before/after of the compiled elementwise chains (fusion.py), back to back in one call: only the logprob
    # kernels compiled (as through run tvp6), then every part.
    1b-fusion) short1b=(--shape llama1b --datums 16 --seq-len 512 --tenants 1 --rounds ${ROUNDS:-5})
               COMPILE=logprob; run_case llama1b_16x512_compile_logprob "${short1b[@]}"
               COMPILE=1; run_case llama1b_16x512_compile_all "${short1b[@]}"; COMPILE= ;;
    8b-fusion) long8b=(--shape llama8b --datums 16 --seq-len 2048 --tenants 1 --rounds ${ROUNDS:-3} --warmup 1 --no-peft)
               COMPILE=logprob; run_case llama8b_16x2048_alone_compile_logprob "${long8b[@]}"
               COMPILE=1; run_case llama8b_16x2048_alone_compile_all "${long8b[@]}" --profile "$OUT"; COMPILE= ;;
    tests) python3 -m pytest tests/gpu/test_megatron_fast_paths.py tests/gpu/test_megatron_families.py -m gpu -o addopts="" --noconftest -p no:cacheprovider \
             -q -rA 2>&1 | tee -a "$OUT/gpu_tests.log" | grep -E "PASSED|FAILED|ERROR|passed|failed" | tee -a "$OUT/summary.log" ;;
    *) echo "unknown case $c" ;;
  esac
done
