#!/usr/bin/env bash
# The families the cookbook defaults to (Qwen3.5) and Tinker serves (gpt-oss), trained by loraplane's torch backend
# against the HF + PEFT loop on one GPU, side by side in one process (bench/trainer_vs_peft.py; issues 32, 33).
# Both sides train rank-32 LoRA on every target the family offers (Qwen3.5: attention, the Gated DeltaNet
# projections, the MLP / experts; gpt-oss: q/k/v/o and the experts), per-expert LoRA on the experts on both sides.
# The torch backend runs each packed row in one call per layer (fla's varlen kernels where fla can run, else
# transformers' torch kernels on a padded batch; fused SDPA sink attention for gpt-oss) and recomputes as many
# decoder layers as the step needs to fit (LORAPLANE_TORCH_RECOMPUTE, default auto); PEFT uses gradient checkpointing.
#   bash scripts/gpu/families_bench.sh [CASE ...]   default: q9b-2048 q9b-512 oss-2048 oss-512
#   cases: q9b-2048 q9b-512 q9b-2048-prof        Qwen3.5-9B, GDN on transformers' torch fallback on both sides
#          q9b-2048-fla q9b-2048-fla-prof        Qwen3.5-9B with fla 0.6 + Triton 3.7.1 (/tmp/fla-site) on both sides
#          oss-2048 oss-512                      gpt-oss-20b
#          q35-peft q35-ours                     Qwen3.5-35B-A3B 8 x 512, each contender alone (two copies do not fit)
#          q35-peft-2048 q35-ours-2048           the same at 8 x 2048; q35-ours-2048-fla with fla
#          tests tests-fla                       tests/gpu/test_packed_fast_paths.py (without / with fla)
#   the megatron backend (each contender alone: ours with --no-peft, the PEFT loop with --tenants ""; ours with the
#   recomputation plan's own choice of layers, then one profiled step):
#          mg-tests mg-tests-fla                 tests/gpu/test_megatron_packed_gdn.py (without / with fla)
#          q9b-mg-2048 q9b-mg-2048-fla           Qwen3.5-9B 8 x 2048, megatron (padded batch / fla kernels)
#          q9b-peft-2048-fla                     the PEFT loop alone with fla
#          q35-mg-2048 q35-mg-2048-fla           Qwen3.5-35B-A3B 8 x 2048, megatron; q35-peft-2048-fla
#          oss-mg-2048 oss-peft-2048             gpt-oss-20b 8 x 2048, megatron / the PEFT loop
#          nemo-peft-2048 nemo-ours-2048         Nemotron-3 Nano 8 x 2048, the PEFT loop / the torch backend
#          nemo-peft-512 nemo-ours-512           the same at 8 x 512
# Needs .gpuwh/megatron and .gpuwh/tvp_extra (bench_env.sh), and .gpuwh/fla for the -fla cases
# (scripts/gpu/fla-wheels.txt; build them with the shared build-wheelhouse.sh).
set -uo pipefail
. "$(dirname "$0")/bench_env.sh" families
{ nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
  python3 -c "import sys, torch, transformers, peft; print(sys.version.split()[0], torch.__version__, 'transformers', transformers.__version__, 'peft', peft.__version__)"
  git log -1 --format='%h %s' 2>/dev/null || true
} 2>&1 | tee -a "$OUT/env.log"
with_fla() {  # fla-core 0.6.0 and Triton 3.7.1 into /tmp/fla-site (once), first on PYTHONPATH for both contenders
  if [ ! -d /tmp/fla-site/fla ]; then
    local work; work=$(mktemp -d)
    cat "$WH"/fla/parts/p* | tar xf - -C "$work" && python3 -m pip install -q --no-index --no-deps --no-compile \
      --no-cache-dir --target /tmp/fla-site "$work"/*.whl || { echo "install of $WH/fla failed" | summary; return 1; }
    rm -rf "$work"
  fi
  case ":$PYTHONPATH:" in *:/tmp/fla-site:*) ;; *) export PYTHONPATH=/tmp/fla-site:$PYTHONPATH ;; esac
  python3 -c "import triton, fla; print('fla', fla.__version__, 'triton', triton.__version__)" 2>&1 | tee -a "$OUT/env.log"
}
run_case() {  # label, then bench args
  local label=$1; shift
  echo "== $label: $*" | summary
  timeout -k 10 "${CASE_TIMEOUT:-280}" python3 bench/trainer_vs_peft.py --backend torch --tenants 1 --modes direct \
    --rank 32 --out "$OUT/$label.json" "$@" > "$OUT/$label.log" 2>&1
  local rc=$?
  grep -v -i -E "warn|^\s*$|falling back" "$OUT/$label.log" | tail -9 | summary
  [ $rc -eq 0 ] || echo "exit code $rc" | summary
  finish
}
run_tests() {  # label [test file]: the packed rows' CUDA paths against the per-datum path
  local file=${2:-tests/gpu/test_packed_fast_paths.py}
  echo "== $1: $file" | summary
  timeout -k 10 "${CASE_TIMEOUT:-400}" python3 -m pytest -q -m gpu --noconftest -o addopts="" -p no:cacheprovider -rA \
    -s "$file" > "$OUT/$1.log" 2>&1
  local rc=$?
  grep -E "^(PASSED|FAILED|SKIPPED|ERROR)|passed|failed" "$OUT/$1.log" | tail -30 | summary
  [ $rc -eq 0 ] || echo "exit code $rc" | summary
  finish
}
Q9=(--shape qwen3.5-9b --datums 8 --peft-checkpointing on --warmup 1)
Q35=(--shape qwen3.5-35b-a3b --datums 8 --warmup 1 --rounds 3)
MG=(--backend megatron --recompute auto --no-peft --datums 8 --seq-len 2048 --warmup 1 --rounds 3 --profile "$OUT")
PEFT=(--tenants "" --peft-checkpointing on --datums 8 --seq-len 2048 --warmup 1 --rounds 3)
MGT=tests/gpu/test_megatron_packed_gdn.py
for c in ${*:-q9b-2048 q9b-512 oss-2048 oss-512}; do
  case "$c" in
    q9b-2048) run_case qwen3.5-9b_8x2048 "${Q9[@]}" --seq-len 2048 --rounds 3 --packed-impl batched ;;
    q9b-512) run_case qwen3.5-9b_8x512 "${Q9[@]}" --seq-len 512 --rounds 4 --packed-impl batched --profile "$OUT" ;;
    q9b-2048-prof) run_case qwen3.5-9b_8x2048_prof "${Q9[@]}" --seq-len 2048 --rounds 2 --packed-impl batched \
      --profile "$OUT" ;;
    # fla's Triton kernels compile and autotune on first use, once per shape class (PEFT's batch and our varlen row).
    q9b-2048-fla) with_fla && CASE_TIMEOUT=${CASE_TIMEOUT:-480} run_case qwen3.5-9b_8x2048_fla "${Q9[@]}" \
      --seq-len 2048 --rounds 3 --packed-impl fla ;;
    q9b-2048-fla-prof) with_fla && CASE_TIMEOUT=${CASE_TIMEOUT:-480} run_case qwen3.5-9b_8x2048_fla_prof "${Q9[@]}" \
      --seq-len 2048 --rounds 2 --packed-impl fla --profile "$OUT" ;;
    oss-2048) run_case gpt-oss-20b_8x2048 --shape gpt-oss-20b --datums 8 --seq-len 2048 --peft-checkpointing on --rounds 3 --warmup 1 ;;
    oss-512) run_case gpt-oss-20b_8x512 --shape gpt-oss-20b --datums 8 --seq-len 512 --peft-checkpointing on --rounds 4 --warmup 1 --profile "$OUT" ;;
    # Qwen3.5-35B-A3B (70 GB in bf16): two copies do not fit one H200, so each contender runs in its own process.
    q35-peft) run_case qwen3.5-35b-a3b_8x512_peft_alone "${Q35[@]}" --seq-len 512 --tenants "" --peft-checkpointing on ;;
    q35-ours) run_case qwen3.5-35b-a3b_8x512_torch_alone "${Q35[@]}" --seq-len 512 --no-peft --packed-impl batched ;;
    q35-peft-2048) CASE_TIMEOUT=${CASE_TIMEOUT:-480} run_case qwen3.5-35b-a3b_8x2048_peft_alone "${Q35[@]}" \
      --seq-len 2048 --tenants "" --peft-checkpointing on ;;
    q35-ours-2048) CASE_TIMEOUT=${CASE_TIMEOUT:-480} run_case qwen3.5-35b-a3b_8x2048_torch_alone "${Q35[@]}" \
      --seq-len 2048 --no-peft --packed-impl batched ;;
    q35-ours-2048-fla) with_fla && CASE_TIMEOUT=${CASE_TIMEOUT:-480} run_case \
      qwen3.5-35b-a3b_8x2048_torch_alone_fla "${Q35[@]}" --seq-len 2048 --no-peft --packed-impl fla ;;
    mg-tests) run_tests mg_gpu_tests $MGT ;;
    mg-tests-fla) with_fla && CASE_TIMEOUT=${CASE_TIMEOUT:-480} run_tests mg_gpu_tests_fla $MGT ;;
    q9b-mg-2048) run_case qwen3.5-9b_8x2048_megatron_alone --shape qwen3.5-9b "${MG[@]}" --packed-impl batched ;;
    q9b-mg-2048-fla) with_fla && CASE_TIMEOUT=${CASE_TIMEOUT:-480} run_case qwen3.5-9b_8x2048_megatron_alone_fla \
      --shape qwen3.5-9b "${MG[@]}" --packed-impl fla ;;
    q9b-peft-2048-fla) with_fla && CASE_TIMEOUT=${CASE_TIMEOUT:-480} run_case qwen3.5-9b_8x2048_peft_alone_fla \
      --shape qwen3.5-9b "${PEFT[@]}" ;;
    q35-mg-2048) CASE_TIMEOUT=${CASE_TIMEOUT:-480} run_case qwen3.5-35b-a3b_8x2048_megatron_alone \
      --shape qwen3.5-35b-a3b "${MG[@]}" --packed-impl batched ;;
    q35-mg-2048-fla) with_fla && CASE_TIMEOUT=${CASE_TIMEOUT:-480} run_case \
      qwen3.5-35b-a3b_8x2048_megatron_alone_fla --shape qwen3.5-35b-a3b "${MG[@]}" --packed-impl fla ;;
    q35-peft-2048-fla) with_fla && CASE_TIMEOUT=${CASE_TIMEOUT:-480} run_case qwen3.5-35b-a3b_8x2048_peft_alone_fla \
      --shape qwen3.5-35b-a3b "${PEFT[@]}" ;;
    oss-mg-2048) run_case gpt-oss-20b_8x2048_megatron_alone --shape gpt-oss-20b "${MG[@]}" ;;
    oss-peft-2048) run_case gpt-oss-20b_8x2048_peft_alone --shape gpt-oss-20b "${PEFT[@]}" ;;
    nemo-peft-2048) run_case nemotron-3-nano_8x2048_peft_alone --shape nemotron-3-nano "${PEFT[@]}" ;;
    nemo-ours-2048) run_case nemotron-3-nano_8x2048_torch_alone --shape nemotron-3-nano --no-peft --datums 8 \
      --seq-len 2048 --warmup 1 --rounds 3 --packed-impl batched ;;
    nemo-peft-512) run_case nemotron-3-nano_8x512_peft_alone --shape nemotron-3-nano --tenants "" \
      --peft-checkpointing on --datums 8 --seq-len 512 --warmup 1 --rounds 2 ;;
    nemo-ours-512) run_case nemotron-3-nano_8x512_torch_alone --shape nemotron-3-nano --no-peft --datums 8 \
      --seq-len 512 --warmup 1 --rounds 2 --packed-impl batched ;;
    tests) run_tests gpu_tests ;;
    tests-fla) with_fla && CASE_TIMEOUT=${CASE_TIMEOUT:-480} run_tests gpu_tests_fla ;;
    *) echo "unknown case $c" | summary ;;
  esac
done
