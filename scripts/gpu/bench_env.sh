# Sourced by the GPU benchmark scripts (trainer_vs_peft.sh, multi_gpu.sh, moe_bench.sh): `. scripts/gpu/bench_env.sh
# NAME`. Everything is written to a work folder $OUT and comes back as $FINAL/NAME.tgz (the device tool returns at
# most 8 files), with summary.log and env.log beside it; the environment every process needs there (no hub, NVLink
# multicast off); megatron-core and the trainer's few pure-Python wheels from the carried .gpuwh parts.
FINAL=${OUT:-/tmp/out}
OUT=$(mktemp -d "/tmp/$1.XXXX")
BENCH_NAME=$1
mkdir -p "$FINAL"
finish() { tar czf "$FINAL/$BENCH_NAME.tgz" -C "$OUT" . ; cp "$OUT/summary.log" "$OUT/env.log" "$FINAL/" 2>/dev/null; }
trap finish EXIT
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 TOKENIZERS_PARALLELISM=false
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True
export PYTHONPATH=.:/tmp/site
WH=${WH:-.gpuwh}
[ -d "$WH" ] || WH=../.gpuwh   # run from a copy of the tree inside the carried checkout
install_parts() {  # DIR with parts/p* -> /tmp/site
  local work; work=$(mktemp -d)
  cat "$1"/parts/p* | tar xf - -C "$work" && python3 -m pip install -q --no-index --no-deps --no-compile \
    --no-cache-dir --target /tmp/site "$work"/*.whl || { echo "install of $1 failed"; exit 3; }
}
[ -d /tmp/site/megatron ] || { install_parts "$WH/megatron"; install_parts "$WH/tvp_extra"; }
summary() { tee -a "$OUT/summary.log"; }
