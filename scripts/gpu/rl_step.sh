#!/usr/bin/env bash
# Issue 34 (item 3): one cookbook `math_rl` step through the tinker SDK, the gateway and `loraplane up`'s cluster on
# one GPU, against the engines' own time for the same work (bench/rl_step.py, docs/benchmarks.md "One `math_rl`
# step"): random bf16 weights in SmolLM2-135M's shape, the sampler on an SGLang server it launches (sharing the GPU
# with the trainer, --mem-fraction-static 0.4), the trainer's torch backend on CUDA; then SGLang's /generate driven
# directly with the last step's adapter version, and the torch backend's forward_backward + optim_step called
# directly. SGLang and the project's deps must be in /tmp/sgsite first: `bash scripts/gpu/e2e.sh install-sglang`
# (after its `part pNN` calls; scripts/gpu/e2e.sh's header lists them). The tinker SDK and the gateway's deps come
# from scripts/gpu/rl_curve.sh's wheelhouse (.gpuwh/rl: build-wheelhouse.sh scripts/gpu/rl_curve-wheels.txt
# .gpuwh/rl, one 33 MB part), installed into /tmp/site by the first call that carries it (after SGLang's pins on
# PYTHONPATH, as rl_curve.sh run-sglang has them):
#   bash scripts/gpu/rl_step.sh [STEPS] [bench/rl_step.py args...]   carry [".gpuwh/rl/parts"] unless /tmp/site has
#                                                                    tinker already; STEPS measured steps after one
#                                                                    warm-up (default 3)
# Results in $OUT: rl_step.log (per step, then the table), rl_step_sglang_cuda.json, sglang_server.log (the tail of
# SGLang's log), rl_step_logs.tgz (every service's log), env.log. Well inside the 10-minute call: the run is killed
# at 540 s (SGLang's start-up is 60-90 s of it).
set -uo pipefail
OUT=${OUT:-/tmp/out}
WH=${WH:-.gpuwh}
[ -d "$WH" ] || WH=../.gpuwh   # run from a copy of the tree inside the carried checkout
mkdir -p "$OUT"
steps=${1:-3}; shift || true
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 TOKENIZERS_PARALLELISM=false
export LORAPLANE_MODEL_CACHE=/tmp/lp-models
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export PYTHONPATH=.:/tmp/sgsite:/tmp/sgsite/nvidia_cutlass_dsl/dsl_packages:/tmp/site:/tmp/pkgs
export PATH=/tmp/sgsite/bin:$PATH
if [ ! -d /tmp/sgsite/sglang ] || [ ! -x /tmp/sgsite/bin/weed ] || [ ! -f /tmp/pkgs/valkey/__init__.py ]; then
  echo "SGLang / the project's deps are not installed in /tmp/sgsite: run scripts/gpu/e2e.sh's part calls and"
  echo "  bash scripts/gpu/e2e.sh install-sglang   (carry .gpuwh/lpx and .gpuwh/tvp_extra) first"
  exit 3
fi
if [ ! -d /tmp/site/tinker ]; then  # the SDK and the gateway's deps (fastapi, uvicorn, zstandard, ...)
  [ -d "$WH/rl/parts" ] || { echo "the tinker SDK is not in /tmp/site: carry .gpuwh/rl/parts (rl_curve.sh's)"; exit 3; }
  work=$(mktemp -d)
  cat "$WH"/rl/parts/p* | tar xf - -C "$work" && python3 -m pip install -q --no-index --no-deps --no-compile \
    --no-cache-dir --upgrade --target /tmp/site "$work"/*.whl || { echo "wheel install failed"; exit 3; }
  rm -rf "$work"
fi
{ nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
  python3 -c "import sys, torch, transformers, sglang, tinker; print(sys.version.split()[0], torch.__version__, torch.version.cuda, 'transformers', transformers.__version__, 'sglang', sglang.__version__, 'tinker', tinker.__version__)"
  git log -1 --format='%h %s' 2>/dev/null || true
} 2>&1 | grep -v -i warn | tee "$OUT/env.log"
WORK=/tmp/lp-rl-step            # the cluster's data dir (bench/rl_step.py --work-dir empties it first)
MODEL=/tmp/lp-rl-step-smollm2   # the random checkpoint, kept across runs; SGLang's --model-path
# What a run killed by its timeout leaves: the cluster of $WORK (its supervisor restarts what dies, so `down` first),
# then every process still carrying that data dir (SGLang's server and schedulers inherit it from the sampler), then
# SGLang servers of this model path (they run in a session of their own) by SIGTERM, which SGLang answers by ending
# its whole process tree.
. "$(dirname "$0")/reap.sh"
reap() {
  local pids
  reap_cluster "$WORK"
  pids=$(pgrep -f "sglang.launch_server --model-path $MODEL" 2>/dev/null)
  [ -n "$pids" ] || return 0
  echo "stopping SGLang servers left by a run: $pids"
  kill $pids 2>/dev/null; sleep 15; kill -9 $pids 2>/dev/null; return 0
}
reap
# On the timeout's SIGTERM bench/rl_step.py stops its cluster on the way out; SIGKILL 20 s later. The limit is 540 s
# from this script's start (an install above takes some of it), so the clean-up after still fits the call.
limit=$(( 540 - SECONDS ))
timeout -k 20 "$limit" python3 bench/rl_step.py --engine sglang --device cuda --model-dir "$MODEL" --work-dir "$WORK" \
  --steps "$steps" "$@" 2>&1 | grep --line-buffered -v -i -E "warn|Loading weights|Writing model shards" \
  | tee "$OUT/rl_step.log"
rc=${PIPESTATUS[0]}
[ "$rc" = 124 ] && echo "killed by its $limit s timeout"
reap
cp bench/results/rl_step_sglang_cuda.json "$OUT/" 2>/dev/null
grep -v -E "^\s*$" "$WORK/sglang/server-0.log" 2>/dev/null | tail -300 > "$OUT/sglang_server.log"
tail -25 "$OUT/sglang_server.log"
tar czf "$OUT/rl_step_logs.tgz" -C "$WORK" logs 2>/dev/null
exit "$rc"
