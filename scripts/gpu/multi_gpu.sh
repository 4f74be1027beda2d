#!/usr/bin/env bash
# The megatron trainer on several GPUs (bench/trainer_multigpu.py; numbers go to docs/benchmarks.md).
#   bash scripts/gpu/multi_gpu.sh [CASE ...]
#   on nvidia-h100-x2:  8b     Llama-3-8B 16 x 2048: one GPU, DP=2, TP=2, one GPU again (drift check), in one call
#                       nodes  DP=2 as two single-GPU "nodes" (c10d rendezvous) + the launcher across them (gRPC)
#   on nvidia-h100-x1:  8b-micro  Llama-3-8B 16 x 2048 on one GPU: micro-batches that fit without recomputation
#                                 (the default) against one pass with recomputed layers, alternated on, off, on
#   on nvidia-h100-x4:  70b    Llama-3-70B 8 x 2048 with TP=4; 70b-tp2dp2 (TP=2 x DP=2, if it fits)
#                       8b-x4  Llama-3-8B 16 x 2048: DP=4 and TP=2 x DP=2
#                       70b-profile  70b, then one more step under the profiler on rank 0 (kernel families, top kernels)
#                       70b-micro    70b in micro-batches of 8,192 and of 4,096 tokens per pass (each may recompute)
#                       fleet-routed the same 8 tenants through the production path (bench/trainer_fleet.py --sequential):
#                                    gRPC trainers of the megatron backend, a registry on Valkey + SeaweedFS, the
#                                    Python client placing and routing adapters; 1 trainer on GPU 0, then 4 on GPUs 0-3
#                                    (also carry .gpuwh/lpx: Valkey, the SeaweedFS binary, the registry's clients, and
#                                    .gpuwh/fleetx: pydantic, cryptography and the few other wheels the image lacks)
#                       fleet4 8 tenants of 2 x 2048 tokens each: one single-GPU trainer holding all 8 (fused) against
#                              four single-GPU trainers side by side holding 2 each (what the fleet's placement does)
# Carry .gpuwh (megatron + tvp_extra parts, wheelhouses as for scripts/gpu/trainer_vs_peft.sh). A case that runs past
# CASE_TIMEOUT (default 420 s) is stopped; what the others measured still returns. Logs and JSON land in $OUT.
set -uo pipefail
. "$(dirname "$0")/bench_env.sh" multi_gpu_logs
{ nvidia-smi --query-gpu=index,name,memory.total,driver_version --format=csv,noheader
  nvidia-smi topo -m 2>/dev/null | head -6
  python3 -c "import sys, torch; print(sys.version.split()[0], torch.__version__, torch.version.cuda, torch.cuda.device_count(), 'GPUs')"
  git log -1 --format='%h %s' 2>/dev/null || true
} 2>&1 | tee -a "$OUT/env.log"
bench() {  # label nproc tp [bench args]: one torchrun job on the first nproc GPUs
  local label=$1 nproc=$2 tp=$3; shift 3
  echo "== $label: $nproc GPU(s), TP=$tp $*" | summary
  timeout -k 10 "${CASE_TIMEOUT:-420}" torchrun --standalone --nproc-per-node "$nproc" bench/trainer_multigpu.py \
    --tp "$tp" --label "$label" --out "$OUT/$label.json" "$@" > "$OUT/$label.log" 2>&1
  local rc=$?
  grep -E "tok/s|Error|error:" "$OUT/$label.log" | grep -v -i warn | tail -4 | summary
  [ $rc -eq 0 ] || echo "exit code $rc" | summary
}
two_nodes() {  # label [bench args]: DP=2 as two torchrun agents of one GPU each, meeting through c10d
  local label=$1; shift
  local rdzv="127.0.0.1:$((29000 + RANDOM % 1000))"
  echo "== $label: 2 nodes x 1 GPU (c10d $rdzv) $*" | summary
  for node in 0 1; do
    CUDA_VISIBLE_DEVICES=$node timeout -k 10 "${CASE_TIMEOUT:-420}" torchrun --nnodes 2 --nproc-per-node 1 \
      --rdzv-backend c10d --rdzv-endpoint "$rdzv" --rdzv-id "$label" bench/trainer_multigpu.py --label "$label" \
      --out "$OUT/$label.json" "$@" > "$OUT/${label}_node$node.log" 2>&1 &
  done
  wait
  cat "$OUT/${label}"_node*.log | grep -E "tok/s|Error|error:" | grep -v -i warn | tail -4 | summary
}
long8b=(--shape llama8b --datums 16 --seq-len 2048 --rounds ${ROUNDS:-4} --warmup 1)
for c in ${*:-8b nodes}; do
  case "$c" in
    8b) bench llama8b_16x2048_1gpu 1 1 "${long8b[@]}"
        bench llama8b_16x2048_dp2 2 1 "${long8b[@]}"
        bench llama8b_16x2048_tp2 2 2 "${long8b[@]}"
        bench llama8b_16x2048_1gpu_again 1 1 "${long8b[@]}" ;;
    8b-micro) bench llama8b_16x2048_micro 1 1 "${long8b[@]}"
              bench llama8b_16x2048_one_pass 1 1 "${long8b[@]}" --micro-batch-tokens 0
              bench llama8b_16x2048_micro_again 1 1 "${long8b[@]}" ;;
    nodes) two_nodes llama8b_16x2048_dp2_2nodes "${long8b[@]}"
           timeout 300 python3 scripts/gpu/launch_check.py --nproc 2 --tp 2 --nnodes 2 2>&1 | grep -v -i warn \
             | tail -3 | tee "$OUT/launch_check_2nodes.log" | summary ;;
    8b-x4) bench llama8b_16x2048_dp4 4 1 "${long8b[@]}"
           bench llama8b_16x2048_tp2dp2 4 2 "${long8b[@]}" ;;
    fleet4) bench llama8b_8tenants_1trainer 1 1 --shape llama8b --datums 16 --seq-len 2048 --tenants 8 --rounds 4 --warmup 1
            echo "== llama8b_8tenants_4trainers: 4 single-GPU trainers at once, 2 tenants each" | summary
            for g in 0 1 2 3; do
              CUDA_VISIBLE_DEVICES=$g timeout -k 10 "${CASE_TIMEOUT:-420}" torchrun --standalone --nproc-per-node 1 \
                bench/trainer_multigpu.py --shape llama8b --datums 4 --seq-len 2048 --tenants 2 --rounds 4 --warmup 1 \
                --label "llama8b_2tenants_trainer$g" --out "$OUT/llama8b_2tenants_trainer$g.json" \
                > "$OUT/llama8b_2tenants_trainer$g.log" 2>&1 &
            done
            wait
            python3 -c "
import json, glob
r = [json.load(open(f)) for f in sorted(glob.glob('$OUT/llama8b_2tenants_trainer*.json'))]
one = json.load(open('$OUT/llama8b_8tenants_1trainer.json'))
agg = sum(x['tokens_per_s'] for x in r)
print(f'4 trainers x 2 tenants: {agg:.0f} tok/s aggregate ({[round(x[\"tokens_per_s\"]) for x in r]}), '
      f'1 trainer x 8 tenants: {one[\"tokens_per_s\"]:.0f} tok/s -> {agg / one[\"tokens_per_s\"]:.2f}x')
" 2>&1 | summary ;;
    70b-profile) bench llama70b_8x2048_tp4_profiled 4 4 --shape llama70b --datums 8 --seq-len 2048 --rounds ${ROUNDS:-3} \
                   --warmup 1 --profile "$OUT/llama70b_8x2048_tp4_profile_rank0.txt"
                 head -12 "$OUT/llama70b_8x2048_tp4_profile_rank0.txt" | summary ;;
    70b-micro) for mb in 8192 4096; do
                 bench "llama70b_8x2048_tp4_mb$mb" 4 4 --shape llama70b --datums 8 --seq-len 2048 --rounds ${ROUNDS:-3} \
                   --warmup 1 --micro-batch-tokens "$mb"
               done ;;
    fleet-routed)
      if [ ! -d /tmp/site/pydantic ]; then
        python3 -m pip install -q --upgrade --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site \
          "$WH"/lpx/wheels/*.whl "$WH"/fleetx/*.whl || { echo "project deps install failed" | summary; continue; }
        mkdir -p /tmp/site/bin && xz -dc "$WH"/lpx/weed.xz > /tmp/site/bin/weed && chmod +x /tmp/site/bin/weed
      fi
      python3 -c "import registry_svc.server, trainer_svc.torchrun, loraplane.client" 2>&1 | tail -3 | summary
      echo "== llama8b_fleet_routed: 1 gRPC trainer x 8 tenants (GPU 0), then 4 x 2 (GPUs 0-3), 2 x 2048 each" | summary
      PATH=/tmp/site/bin:$PATH timeout -k 10 "${CASE_TIMEOUT:-560}" python3 bench/trainer_fleet.py --sequential \
        --backend megatron --shape llama8b --device cuda --trainers 4 --tenants 8 --datums 2 --seq-len 2048 \
        --rank 32 --steps 3 --rounds ${ROUNDS:-3} --gpus 0,1,2,3 --one-gpu 0 --work /tmp/fleet-work \
        > "$OUT/llama8b_fleet_routed.log" 2>&1
      echo "exit code $?" | summary
      cp bench/results/trainer_fleet.json "$OUT/llama8b_fleet_routed.json" 2>/dev/null
      mkdir -p "$OUT/fleet_logs" && cp /tmp/fleet-work/*.log "$OUT/fleet_logs/" 2>/dev/null
      grep -v -i warn "$OUT/llama8b_fleet_routed.log" | tail -12 | summary ;;
    70b) bench llama70b_8x2048_tp4 4 4 --shape llama70b --datums 8 --seq-len 2048 --rounds ${ROUNDS:-3} --warmup 1 ;;
    70b-tp2dp2) bench llama70b_8x2048_tp2dp2 4 2 --shape llama70b --datums 8 --seq-len 2048 --rounds ${ROUNDS:-3} --warmup 1 ;;
    *) echo "unknown case $c" ;;
  esac
done
