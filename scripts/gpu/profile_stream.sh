#!/usr/bin/env bash
# Where the sampler's time goes at 256 concurrent streams (issue 12's TTFT miss): bench/sampler_vs_sglang.py at
# 256 x 8 adapters, with py-spy (carried in SGLang's wheel set) sampling the sampler_svc process and the bench
# process (the clients) while it runs; the sampler's stream reader processes (STREAM_READERS, default 4; 0: none) are
# sampled with it (--subprocesses: their stacks carry their own pid). Needs the SGLang install of
# scripts/gpu/e2e.sh (its parts and `install-sglang`). Folded stacks land in $OUT (sampler.folded, bench.folded).
set -uo pipefail
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 LORAPLANE_MODEL_CACHE=/tmp/lp-models
export PYTHONPATH=.:/tmp/sgsite:/tmp/sgsite/nvidia_cutlass_dsl/dsl_packages PATH=/tmp/sgsite/bin:$PATH
# pip --target leaves py-spy's binary out of /tmp/sgsite/bin: take it from the staged SGLang parts.
PYSPY=$(command -v py-spy || ls /tmp/pyspy/py-spy 2>/dev/null)
if [ -z "$PYSPY" ]; then
  mkdir -p /tmp/pyspy && cat /tmp/sgparts/p* | tar xf - -C /tmp/pyspy --wildcards 'py_spy-*.whl' \
    && python3 -c "import glob, zipfile; z = zipfile.ZipFile(glob.glob('/tmp/pyspy/py_spy-*.whl')[0]); \
open('/tmp/pyspy/py-spy', 'wb').write(z.read(next(n for n in z.namelist() if n.endswith('/py-spy'))))" \
    && chmod +x /tmp/pyspy/py-spy
  PYSPY=/tmp/pyspy/py-spy
fi
python3 bench/sampler_vs_sglang.py --build-shape llama1b --model-dir /tmp/llama1b --concurrency 256 --mixes mixed8 \
  --rounds 1 --no-old-path --stream-readers "${STREAM_READERS:-4}" > "$OUT/bench.log" 2>&1 &
bench=$!
until pid=$(pgrep -f -- "-m sampler_svc --engine" | head -1) && [ -n "$pid" ]; do kill -0 $bench 2>/dev/null || { tail -5 "$OUT/bench.log"; exit 1; }; sleep 1; done
until grep -q '"concurrency": 256' "$OUT/bench.log"; do sleep 0.5; done  # the throughput row: latency comes next
"$PYSPY" record -r 200 -d 12 -p "$pid" --subprocesses -f raw -o "$OUT/sampler.folded" --nonblocking \
  > "$OUT/pyspy_sampler.log" 2>&1 &
"$PYSPY" record -r 200 -d 12 -p "$bench" -f raw -o "$OUT/bench.folded" --nonblocking > "$OUT/pyspy_bench.log" 2>&1 &
wait $bench
wait
grep -E "ttft|\| 256" "$OUT/bench.log" | tail -5
cat "$OUT"/pyspy_*.log | tail -6
