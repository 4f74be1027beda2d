#!/usr/bin/env bash
# Issue 22's serving half on one GPU machine: Qwen3-MoE expert LoRA through sampler_svc on a real SGLang 0.5.17.
# SGLang and the project's deps must be in /tmp/sgsite first: `bash scripts/gpu/e2e.sh install-sglang` (after its
# `part pNN` calls; scripts/gpu/e2e.sh's header lists them). Each mode stays well inside the 10-minute call limit.
#   bash scripts/gpu/moe_serve.sh tests [PYTEST -k EXPR]   tests/gpu/test_sglang_moe.py (a small random Qwen3-MoE,
#                                                         trainer Forward vs sampler, batches, layouts, retention)
#   bash scripts/gpu/moe_serve.sh families [PYTEST -k EXPR] tests/gpu/test_sglang_families.py: Qwen3.5 dense and
#                                                         MoE, gpt-oss and Nemotron-H (small random checkpoints)
#                                                         served by SGLang, sampler vs the trainer's Forward,
#                                                         version exactness (issues 32, 33); a family takes
#                                                         1.5-2 min: two calls, -k "gpt_oss or nemotron" and
#                                                         -k qwen3_5
#   bash scripts/gpu/moe_serve.sh load [ITER] [LAYERS]    bench/sampler.py --shape qwen3moe: publish -> first
#                                                         sample of a Qwen3-30B-A3B rank-32 expert adapter (dummy
#                                                         weights, one SGLang server): both expert layouts
#                                                         (per_expert, shared_outer) x both forms the experts reach
#                                                         SGLang in (per-expert keys, stacked 3-D tensors), ITER
#                                                         versions each (default 2) after one warm-up version, each
#                                                         2.6 GB bf16 in the registry and handed to SGLang through
#                                                         /dev/shm; every version's phases are printed as it
#                                                         completes, no version starts after 430 s; LAYERS the
#                                                         first N of the 48 only
#   bash scripts/gpu/moe_serve.sh push [ITER] [LAYERS]    bench/sampler.py --push --shape qwen3moe: publish -> first
#                                                         sample of the same adapters published as PublishWeights
#                                                         does it (shared-outer in the compact format 2, and
#                                                         per-expert): pushed by the trainer's handoff through
#                                                         /dev/shm, pushed as a gRPC stream, or not pushed (the
#                                                         registry path), alternated, ITER versions each (default
#                                                         2) after one warm-up per path; the path each version took,
#                                                         and a nonzero exit when one took another; no version
#                                                         starts after 430 s
#   bash scripts/gpu/moe_serve.sh push-compact [ITER] [LAYERS]  the same for the shared-outer adapter only, served
#                                                         by SGLang's own shared-outer expert LoRA (the compact
#                                                         factors sent as they are); shared memory and registry
#   bash scripts/gpu/moe_serve.sh push-compact-overlap [ITER]   the same with SGLang's --enable-lora-overlap-loading
#   bash scripts/gpu/moe_serve.sh e2e [ITER]              python -m tests.production_e2e --moe: torch
#                                                         trainer + SGLang sampler (eager) on a 3-layer random
#                                                         Qwen3-MoE, two tenants' GRPO loop (ITER 12)
# Results in $OUT (at most 8 files come back): the mode's log and JSON, env.log, and a .tgz of the server logs.
set -uo pipefail
mode=${1:-}; shift || true
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 TOKENIZERS_PARALLELISM=false
export LORAPLANE_MODEL_CACHE=/tmp/lp-models
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export PYTHONPATH=.:/tmp/sgsite:/tmp/sgsite/nvidia_cutlass_dsl/dsl_packages:/tmp/pkgs PATH=/tmp/sgsite/bin:$PATH
if [ ! -d /tmp/sgsite/sglang ] || [ ! -x /tmp/sgsite/bin/weed ] || [ ! -f /tmp/pkgs/valkey/__init__.py ]; then
  echo "SGLang / the project's deps are not installed in /tmp/sgsite: run scripts/gpu/e2e.sh's part calls and"
  echo "  bash scripts/gpu/e2e.sh install-sglang   (carry .gpuwh/lpx and .gpuwh/tvp_extra) first"
  exit 3
fi
{ nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
  python3 -c "import sys, torch, transformers, sglang; print(sys.version.split()[0], torch.__version__, torch.version.cuda, 'transformers', transformers.__version__, 'sglang', sglang.__version__)"
  git log -1 --format='%h %s' 2>/dev/null || true
} 2>&1 | grep -v -i warn | tee "$OUT/env.log"
filter() { grep --line-buffered -v -i -E "warn|Loading weights|Writing model shards"; }
# An SGLang server runs in a session of its own, so a run the timeout kills leaves it holding the GPU: the servers
# this mode launches (named by their model path, which is this mode's own) get SIGTERM, which SGLang answers by
# ending its whole process tree, before and after the run.
reap() {
  local pids; pids=$(pgrep -f "sglang.launch_server --model-path $1" 2>/dev/null)
  [ -n "$pids" ] || return 0
  echo "stopping SGLang servers left by an earlier run: $pids"
  kill $pids 2>/dev/null; sleep 15; kill -9 $pids 2>/dev/null; return 0
}
qwen3moe_bench() {  # MODE (load | push) JSON_NAME WORKDIR SERVER_LOG [ITER] [LAYERS]: bench/sampler.py --shape qwen3moe
  local mode=$1 json=$2 work=$3 server=$4 iterations=${5:-2} layers=${6:-0} push=() rc
  [ "$mode" = push ] && push=(--push "${PUSH_ARGS[@]}")
  reap /tmp/lp-model-qwen3moe
  # The versions reach SGLang through /dev/shm (and the colocated push maps its segment there).
  df -h /dev/shm /tmp | tee -a "$OUT/env.log"
  timeout -k 20 560 python3 bench/sampler.py "${push[@]}" --engine sglang --shape qwen3moe --iterations "$iterations" \
    --layers "$layers" --deadline-s 430 2>&1 | filter | tee "$OUT/${mode}_qwen3moe.log"
  rc=${PIPESTATUS[0]}
  reap /tmp/lp-model-qwen3moe
  cp "bench/results/$json.json" "$OUT/$json.json" 2>/dev/null
  grep -v -E "^\s*$" "$work/sglang/server-0.log" 2>/dev/null | tail -300 > "$OUT/$server.log"
  tail -25 "$OUT/$server.log"
  exit "$rc"
}
case "$mode" in
  tests)
    reap /tmp/lp-moe-tests
    # A limit under the call's 10 minutes keeps the output; the SGLang start-up inside is bounded by the fixture.
    timeout -k 20 540 python3 -m pytest tests/gpu/test_sglang_moe.py -m gpu -o addopts="" -p no:cacheprovider -q -rA \
      --basetemp /tmp/lp-moe-tests ${1:+-k "$1"} 2>&1 | filter | tee "$OUT/sglang_moe_tests.log" \
      | grep -E "PASSED|FAILED|ERROR|passed|failed|Error|assert"
    rc=${PIPESTATUS[0]}
    reap /tmp/lp-moe-tests
    find /tmp/lp-moe-tests -name "server-*.log" -print0 2>/dev/null | tar czf "$OUT/sglang_moe_tests_servers.tgz" \
      --null -T - 2>/dev/null
    exit "$rc" ;;
  families)
    reap /tmp/lp-family-tests
    timeout -k 20 520 python3 -m pytest tests/gpu/test_sglang_families.py -m gpu -o addopts="" -p no:cacheprovider -v \
      -rA --tb=short --basetemp /tmp/lp-family-tests ${1:+-k "$1"} 2>&1 | filter | tee "$OUT/sglang_families_tests.log" \
      | grep -E "PASSED|FAILED|ERROR|passed|failed|Error|assert"
    rc=${PIPESTATUS[0]}
    reap /tmp/lp-family-tests
    find /tmp/lp-family-tests -name "server-*.log" -print0 2>/dev/null \
      | tar czf "$OUT/sglang_families_servers.tgz" --null -T - 2>/dev/null
    exit "$rc" ;;
  load)
    qwen3moe_bench load sampler_sglang_load_qwen3moe /tmp/lp-bench-load-qwen3moe sglang_server_qwen3moe "$@" ;;
  push)
    PUSH_ARGS=()
    qwen3moe_bench push sampler_push_qwen3moe /tmp/lp-bench-push-qwen3moe sglang_server_push_qwen3moe "$@" ;;
  push-compact|push-compact-overlap)
    # The compact shared-outer adapter as it is (SGLang's --experts-shared-outer-loras), not expanded per expert;
    # -overlap: SGLang pins an adapter's weights when it loads it and copies them in beside the batches
    # (--enable-lora-overlap-loading) instead of pinning and copying at the adapter's first batch.
    PUSH_ARGS=(--expert-layouts shared_outer --push-paths push:shared_memory registry --sglang-expert-form shared_outer)
    [ "$mode" = push-compact-overlap ] && PUSH_ARGS+=(--sglang-server-arg=--enable-lora-overlap-loading)
    qwen3moe_bench push sampler_push_qwen3moe /tmp/lp-bench-push-qwen3moe sglang_server_push_qwen3moe "$@" ;;
  e2e)
    stop_e2e_cluster() {  # what a killed run left: the supervised cluster (trainer on the GPU) and SGLang
      python3 -c "from pathlib import Path; from loraplane_cli.local_cluster import read_cluster_state, stop_cluster
state = read_cluster_state(Path('/tmp/e2e-moe')) if Path('/tmp/e2e-moe').is_dir() else None
state and stop_cluster(state, timeout=5.0)" 2>&1 | tail -3
      reap /tmp/e2e-moe
    }
    stop_e2e_cluster
    rm -rf /tmp/e2e-moe
    timeout -k 20 560 python3 -m tests.production_e2e --moe --require-reward-rise --sglang-eager ${1:+--iterations "$1"} \
      --data-dir /tmp/e2e-moe --out "$OUT/production_e2e_moe.json" 2>&1 | filter \
      | tee "$OUT/production_e2e_moe.log" | grep -E "iter|PASS|FAIL|wrote|cluster"
    rc=${PIPESTATUS[0]}
    stop_e2e_cluster
    tar czf "$OUT/e2e_moe_logs.tgz" --exclude=adapters -C /tmp/e2e-moe logs sglang 2>/dev/null
    exit "$rc" ;;
  *) echo "unknown mode '$mode' (tests [-k EXPR] | load [ITER] [LAYERS] | push [ITER] [LAYERS] | e2e [ITER])"; exit 2 ;;
esac
