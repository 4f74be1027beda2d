#!/usr/bin/env bash
# Issue 12's sampler measurements on one GPU machine. SGLang 0.5.17 and the project's deps are staged and installed
# into /tmp/sgsite by scripts/gpu/e2e.sh (its header lists the calls): the 12 `e2e.sh part pNN` calls back to back
# on one warm machine (it goes back 30 s after a call), then `e2e.sh install-sglang` (or a full `e2e.sh` run).
# Then, from a copy of the source tree in .gpuwork:
#   bash scripts/gpu/sampler_vs_sglang.sh bench [bench args...] (bench/sampler_vs_sglang.py, Llama-3.2-1B shape;
#       without args: 8 adapters at 16/64/256 concurrent, raw SGLang vs sampler_svc via bare gRPC stubs vs via
#       SamplingClient, each client in its own process: tokens/s of Sample (3 rounds) and streaming TTFT / ITL /
#       TPOT (3 rounds), the sampler reading SGLang's streams in 4 reader processes (stubs, client) and, alternated
#       with them, a second sampler reading them on its serving loop (stubs_old); about 6 minutes on an H100)
#       (--client-processes N: N measuring processes per path, each its own connection; one Python process
#       receiving 256 streams saturates its core)
#   bash scripts/gpu/sampler_vs_sglang.sh two-servers [bench args...] (2-GPU machine: SGLang on GPU 0 and GPU 1;
#       one sampler_svc with both servers vs one with GPU 0's, alternated with raw SGLang on GPU 0: Sample and
#       stream tokens/s, TTFT, ITL at 256 concurrent over 8 adapters, 3 rounds; issue 23's target two/one >= 1.8;
#       about 5 minutes)
#   bash scripts/gpu/sampler_vs_sglang.sh fleet [bench args...] (2-GPU machine: SGLang on GPU 0 and GPU 1; a sampler
#       fleet of two sampler_svc replicas, fleet-a with GPU 0's server and fleet-b with GPU 1's, reached through one
#       SamplingClient that routes each adapter, vs one sampler_svc with GPU 0's, alternated with raw SGLang on GPU 0
#       and over both servers: Sample and stream tokens/s, TTFT, ITL, per-replica requests at 256 concurrent over 8
#       adapters, 3 rounds; issue 23's target fleet/one >= 1.8)
#   bash scripts/gpu/sampler_vs_sglang.sh load SHAPE ITERATIONS [WAY...] (bench/sampler.py: publish -> first
#       sample per way a version reaches SGLang, transport:blob dtype, default file:float32 file:bfloat16;
#       SHAPE smollm2 | llama8b)
#   bash scripts/gpu/sampler_vs_sglang.sh push SHAPE [ITERATIONS] [PATH...] (bench/sampler.py --push: publish ->
#       first sample where each version is published as PublishWeights does it, pushed by the trainer's handoff to
#       the sampler beside the registry upload, alternated with versions that are not pushed; PATH of
#       push:shared_memory push:stream registry, default all; the path each version took, and a nonzero exit when
#       one took another; SHAPE llama8b | smollm2, ITERATIONS default 6; the MoE shape: moe_serve.sh push)
#   bash scripts/gpu/sampler_vs_sglang.sh tests [PYTEST -k EXPR] (tests/gpu/test_sglang_engine.py: the engine against
#       a real server, CUDA graphs vs --disable-cuda-graph among them)
#   bash scripts/gpu/sampler_vs_sglang.sh publish [ROUNDS] (bench/publish.py on this host: PublishWeights' export +
#       upload of the 8B-shape rank-32 adapter into a registry on Valkey + SeaweedFS here, issue 11's last target)
set -uo pipefail
mode=$1; shift
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 LORAPLANE_MODEL_CACHE=/tmp/lp-models
export PYTHONPATH=.:/tmp/sgsite:/tmp/sgsite/nvidia_cutlass_dsl/dsl_packages:/tmp/pkgs PATH=/tmp/sgsite/bin:$PATH
case "$mode" in
  load)
    nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
    shape=$1; iterations=${2:-6}; shift $(( $# < 2 ? $# : 2 )); ways=${*:+--ways $*}
    python3 bench/sampler.py --engine sglang --shape "$shape" --iterations "$iterations" $ways 2>&1 \
      | grep --line-buffered -v -i -E "warn|Loading weights" | tee "$OUT/load_$shape.log"
    cp bench/results/sampler_sglang_load_$shape.json "$OUT/" 2>/dev/null
    grep -v -E "^\s*$" /tmp/lp-bench-load-$shape/sglang/server-0.log | tail -150 > "$OUT/sglang_server_$shape.log" 2>/dev/null
    tail -25 "$OUT/sglang_server_$shape.log" ;;
  push)
    nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
    shape=${1:-llama8b}; iterations=${2:-6}; shift $(( $# < 2 ? $# : 2 )); paths=${*:+--push-paths $*}
    df -h /dev/shm | tail -1  # the colocated push goes through it
    python3 bench/sampler.py --push --engine sglang --shape "$shape" --iterations "$iterations" $paths 2>&1 \
      | grep --line-buffered -v -i -E "warn|Loading weights" | tee "$OUT/push_$shape.log"
    rc=${PIPESTATUS[0]}
    cp bench/results/sampler_push_$shape.json "$OUT/" 2>/dev/null
    grep -v -E "^\s*$" /tmp/lp-bench-push-$shape/sglang/server-0.log | tail -150 > "$OUT/sglang_server_push_$shape.log" 2>/dev/null
    tail -25 "$OUT/sglang_server_push_$shape.log"
    exit "$rc" ;;
  bench)
    nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
    [ $# -eq 0 ] && set -- --concurrency 16 64 256 --mixes mixed8 --rounds 3 --latency-rounds 3
    python3 -c "import uvloop" 2>/dev/null && echo "uvloop: yes (sampler_svc runs on it)" || echo "uvloop: no"
    python3 bench/sampler_vs_sglang.py --build-shape llama1b --model-dir /tmp/llama1b "$@" 2>&1 \
      | grep -v -i -E "warn|Loading weights" | tee "$OUT/sampler_vs_sglang.log"
    cp bench/results/sampler_vs_sglang.json "$OUT/" 2>/dev/null
    tail -50 /tmp/lp-bench-sglang/sampler.log > "$OUT/sampler_svc.log" 2>/dev/null
    tail -50 /tmp/lp-bench-sglang/sampler-old.log > "$OUT/sampler_svc_old.log" 2>/dev/null
    tail -80 /tmp/lp-bench-sglang/sglang/server-0.log > "$OUT/sglang_server.log" 2>/dev/null ;;
  two-servers)
    nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
    [ "$(nvidia-smi -L | wc -l)" -ge 2 ] || { echo "two-servers needs 2 GPUs"; exit 2; }
    [ $# -eq 0 ] && set -- --concurrency 256 --rounds 3
    python3 bench/sampler_vs_sglang.py --build-shape llama1b --model-dir /tmp/llama1b --two-servers \
      --out bench/results/sampler_two_servers.json "$@" 2>&1 \
      | grep -v -i -E "warn|Loading weights" | tee "$OUT/sampler_two_servers.log"
    cp bench/results/sampler_two_servers.json "$OUT/" 2>/dev/null
    for name in sampler sampler-two; do tail -50 /tmp/lp-bench-sglang/$name.log > "$OUT/$name.log" 2>/dev/null; done
    for i in 0 1; do tail -60 /tmp/lp-bench-sglang/sglang/server-$i.log > "$OUT/sglang_server_$i.log" 2>/dev/null; done ;;
  fleet)
    nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
    [ "$(nvidia-smi -L | wc -l)" -ge 2 ] || { echo "fleet needs 2 GPUs"; exit 2; }
    [ $# -eq 0 ] && set -- --concurrency 256 --rounds 3
    python3 bench/sampler_vs_sglang.py --build-shape llama1b --model-dir /tmp/llama1b --two-servers --fleet \
      --out bench/results/sampler_fleet.json "$@" 2>&1 \
      | grep -v -i -E "warn|Loading weights" | tee "$OUT/sampler_fleet.log"
    cp bench/results/sampler_fleet.json "$OUT/" 2>/dev/null
    for name in sampler sampler-fleet-a sampler-fleet-b; do
      tail -50 /tmp/lp-bench-sglang/$name.log > "$OUT/$name.log" 2>/dev/null
    done
    for i in 0 1; do tail -60 /tmp/lp-bench-sglang/sglang/server-$i.log > "$OUT/sglang_server_$i.log" 2>/dev/null; done ;;
  tests)  # /tmp/pkgs holds the `valkey` stub pytest needs, made by e2e.sh's install
    python3 -m pytest tests/gpu/test_sglang_engine.py -m gpu -o addopts="" -p no:cacheprovider -q -rA ${1:+-k "$1"} 2>&1 \
      | grep --line-buffered -v -i warn | tee "$OUT/sglang_gpu_tests.log" | grep -E "PASSED|FAILED|ERROR|passed|failed|Error"
    exit "${PIPESTATUS[0]}" ;;
  publish)
    python3 bench/publish.py --shapes llama3-8b-r32,smollm2-135m-r16 --rounds "${1:-6}" 2>&1 \
      | grep -v -i warn | tee "$OUT/publish.log" | tail -20
    cp bench/results/publish.json "$OUT/" 2>/dev/null ;;
  *) echo "unknown mode $mode (bench [args] | two-servers [args] | fleet [args] | load SHAPE ITERATIONS [WAY...] | tests [-k EXPR] |"
     echo "  publish [ROUNDS] | push SHAPE [ITERATIONS] [PATH...];"
     echo "installing is scripts/gpu/e2e.sh's)"
     exit 2 ;;
esac
