#!/usr/bin/env bash
# The fused expert-LoRA forward kernel on one GPU (issue 35 item 1): its GPU tests against the pure-torch reference
# (tests/gpu/test_megatron_expert_kernels.py), then the micro-benchmark against the unfused path at Qwen3-30B-A3B's
# expert shapes (scripts/gpu/expert_kernels_bench.py, one JSON line per GEMM and a summary line).
#   bash scripts/gpu/expert_kernels.sh            (from the repository root; needs torch with CUDA and Triton)
# Output also goes to $OUT (default /tmp/out): tests.log, bench.jsonl, env.log.
set -uo pipefail
cd "$(dirname "$0")/../.."
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 PYTHONPATH=.:/tmp/site${PYTHONPATH:+:$PYTHONPATH}
{ nvidia-smi --query-gpu=index,name,memory.total,driver_version --format=csv,noheader
  python3 -c "import sys, torch, triton; print(sys.version.split()[0], torch.__version__, torch.version.cuda, 'triton', triton.__version__)"
  git log -1 --format='%h %s' 2>/dev/null || true
} 2>&1 | tee "$OUT/env.log"
python3 -m pytest -q -m gpu --noconftest -o addopts="" -p no:cacheprovider tests/gpu/test_megatron_expert_kernels.py \
  2>&1 | tee "$OUT/tests.log"
tests=${PIPESTATUS[0]}
python3 scripts/gpu/expert_kernels_bench.py --sweep "$@" 2>&1 | tee "$OUT/bench.jsonl"
bench=${PIPESTATUS[0]}
echo "tests exit $tests, bench exit $bench" | tee -a "$OUT/env.log"
[ "$tests" -eq 0 ] && [ "$bench" -eq 0 ]
