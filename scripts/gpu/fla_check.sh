#!/usr/bin/env bash
# fla's Gated DeltaNet kernel with the carried Triton 3.7.1: correct (against our fp32 recurrence) and how fast
# (against transformers' torch fallback), then the PEFT loop on Qwen3.5-9B with fla — the stronger anchor.
#   bash scripts/gpu/fla_check.sh [peft]      needs .gpuwh/fla (scripts/gpu/fla-wheels.txt) carried
set -uo pipefail
. "$(dirname "$0")/bench_env.sh" fla_check
[ -d /tmp/fla-site/fla ] || bash ../shared/gpu/install-wheelhouse.sh "$WH/fla/parts" /tmp/fla-site 2>/dev/null \
  || { work=$(mktemp -d); cat "$WH"/fla/parts/p* | tar xf - -C "$work" && python3 -m pip install -q --no-index \
       --no-deps --no-compile --no-cache-dir --target /tmp/fla-site "$work"/*.whl; }
export PYTHONPATH=/tmp/fla-site:$PYTHONPATH
python3 scripts/gpu/fla_check.py --json "$OUT/fla_check.json" 2>&1 | grep -v -i warn | summary
if [ "${1:-}" = peft ]; then
  timeout -k 10 280 python3 bench/trainer_vs_peft.py --backend torch --shape qwen3.5-9b --datums 8 --seq-len 2048 \
    --tenants "" --modes direct --rank 32 --peft-checkpointing on --rounds 3 --warmup 1 \
    --out "$OUT/peft_fla_q9b_8x2048.json" > "$OUT/peft_fla.log" 2>&1
  grep -v -i -E "warn|^\s*$" "$OUT/peft_fla.log" | tail -8 | summary
fi
