"""Compact expert adapters end to end on CPU (issue 34 item 2): a real trainer and a real torch-engine sampler of one
sampler fleet on `tiny-moe`, on a real registry (Valkey + SeaweedFS), all on loopback. A shared-outer adapter's
published version is compact (format "2", its shared factors once) in the registry and in the trainer's in-memory
push, and the sampler serves it with the trainer's logprobs; a blob written the old, expanded way (format "1") still
publishes and serves the same; and its Tinker-layout export imports as a new adapter that a trainer loads, computes
the same logprobs with, and trains."""

from __future__ import annotations

import pytest

from loraplane.adapter_format import (
    COMPACT_FORMAT,
    FORMAT_VERSION_KEY,
    blob_metadata,
    materialize_tinker_dir,
    parse_adapter,
    parse_training_state,
    serialize_adapter,
)
from loraplane.v1 import common_pb2, sampler_pb2, trainer_pb2
from loraplane_cli.adapter_io import export_adapter, import_tinker_adapter
from tests.fixtures.sampler import start_live_sampler
from tests.fixtures.trainer import Sequenced, start_live_trainer

FLEET = "samplers"
PROMPT = [17, 42, 99, 7, 120, 64]
DATA = [trainer_pb2.Datum(input_tokens=[5, 6, 7, 8, 9, 30, 31], target_tokens=[6, 7, 8, 9, 30, 31, 32]),
        trainer_pb2.Datum(input_tokens=[40, 41, 42, 43], target_tokens=[41, 42, 43, 44])]
ADAM = trainer_pb2.AdamParams(learning_rate=0.05, beta1=0.9, beta2=0.999, eps=1e-8)
SHARED_OUTER = common_pb2.EXPERT_LORA_LAYOUT_SHARED_OUTER


@pytest.fixture
def deployment(registry, background_loop):
    settings = registry.settings.model_copy(update={"sampler_fleet": FLEET, "sampler_heartbeat_ttl_s": 1.0})
    started = []
    try:
        sampler = start_live_sampler(settings, background_loop, registry.address, instance_id="sampler-a",
                                     fleet=FLEET, base_model="tiny-moe")
        started.append(sampler)
        trainer = start_live_trainer(settings, background_loop, registry.address, gap_timeout_s=5.0,
                                     base_model="tiny-moe")
        started.append(trainer)
        yield trainer, sampler
    finally:
        for live in reversed(started):
            live.close()


def create(stub, name: str) -> None:
    stub.CreateAdapter(trainer_pb2.TrainerServiceCreateAdapterRequest(
        name=name, lora_config=common_pb2.LoraConfig(rank=4, alpha=8, seed=3, expert_layout=SHARED_OUTER),
        base_model="tiny-moe"))


def sample(live, name: str, version: int) -> sampler_pb2.SampleResponse:
    return live.stub().Sample(sampler_pb2.SampleRequest(
        adapter=common_pb2.AdapterRef(name=name, version=version), prompt_tokens=PROMPT,
        sampling_params=common_pb2.SamplingParams(max_tokens=8, temperature=1.0, seed=21)), timeout=60)


def forward_logprobs(driver: Sequenced, tokens: list[int]) -> list[float]:
    out = driver.forward([trainer_pb2.Datum(input_tokens=tokens[:-1], target_tokens=tokens[1:])]).outputs[0]
    return list(out.logprobs)


def served_as_trained(live, driver: Sequenced, version: int) -> list[float]:
    """Samples `version` and checks the sampled tokens' logprobs equal the trainer's Forward (1e-4); returns them."""
    reply = sample(live, driver.name, version)
    assert reply.served_version == version
    tokens = PROMPT + list(reply.sequences[0].tokens)
    learned = forward_logprobs(driver, tokens)[len(PROMPT) - 1:]
    assert list(reply.sequences[0].logprobs) == pytest.approx(learned, abs=1e-4)
    return list(reply.sequences[0].logprobs)


def test_a_shared_outer_version_is_compact_in_the_registry_and_the_push_and_served_exactly(deployment, tmp_path):
    trainer, sampler = deployment
    stub = trainer.stub()
    create(stub, "so")
    driver = Sequenced(stub, "so", ADAM)
    driver.train(DATA)
    version = stub.PublishWeights(trainer_pb2.PublishWeightsRequest(adapter="so", seq_id=driver.next())).version
    blob = trainer.download("so", version.version)
    assert blob_metadata(blob)[FORMAT_VERSION_KEY] == COMPACT_FORMAT
    params, spec, base_name = parse_adapter(blob)
    assert spec.expert_layout == "shared_outer"
    assert blob == serialize_adapter(params, spec, base_name)  # the trainer wrote exactly the compact file
    expanded = serialize_adapter(params, spec, base_name, compact=False)
    assert version.size_bytes == len(blob) < len(expanded)
    # The in-memory push carried those very bytes (same digest), and the sampler loaded them from it.
    sampler.wait_loaded({f"so@v{version.version}"})
    loaded = next(e for e in sampler.manager.list_loaded() if e.key == f"so@v{version.version}")
    assert (loaded.path, loaded.sha256) == ("push", version.sha256)
    assert trainer.service.handoff.pushes["shared_memory"] == 1
    compact_logprobs = served_as_trained(sampler, driver, version.version)

    # A blob written the old way (shared factors repeated per expert, no format key) still publishes and serves.
    old = sampler.publish("so", expanded)
    assert FORMAT_VERSION_KEY not in blob_metadata(trainer.download("so", old.version))
    sampler.wait_loaded({f"so@v{old.version}"})
    assert sample(sampler, "so", old.version).sequences[0].logprobs == pytest.approx(compact_logprobs, abs=1e-6)

    # Exports: HF PEFT per expert (as always), Tinker's layout compact.
    peft_dir = sampler.registry_call(lambda c: export_adapter(c, "so", tmp_path / "peft", version=version.version))
    assert (peft_dir / "adapter_model.safetensors").stat().st_size > len(blob)
    tinker_dir = sampler.registry_call(lambda c: export_adapter(c, "so", tmp_path / "tinker", version=version.version,
                                                                fmt="tinker"))
    assert (tinker_dir / "adapter_model.safetensors").stat().st_size < len(expanded)


def test_a_tinker_adapter_imports_loads_with_the_same_logprobs_and_trains(deployment, tmp_path):
    trainer, sampler = deployment
    stub = trainer.stub()
    create(stub, "origin")
    origin = Sequenced(stub, "origin", ADAM)
    origin.train(DATA)
    version = stub.PublishWeights(trainer_pb2.PublishWeightsRequest(adapter="origin", seq_id=origin.next())).version
    directory = materialize_tinker_dir(trainer.download("origin", version.version), tmp_path / "tinker")

    imported = sampler.registry_call(lambda c: import_tinker_adapter(c, directory, "ten/imported"))
    assert imported.expert_layout == "shared_outer"
    kinds = {v.version: v.kind for v in trainer.registry_versions("ten/imported")}
    assert kinds == {imported.state_version: common_pb2.VERSION_KIND_TRAINING_STATE,
                     imported.weights_version: common_pb2.VERSION_KIND_WEIGHTS}
    assert blob_metadata(trainer.download("ten/imported", imported.weights_version))[FORMAT_VERSION_KEY] == "2"

    # A trainer adapter of the same shape attaches to the imported one and loads its training state.
    create(stub, "ten/imported")
    driver = Sequenced(stub, "ten/imported", ADAM)
    driver.load("ten/imported", imported.state_version, with_optimizer=True)
    tokens = PROMPT + [5, 6, 7, 8]
    assert forward_logprobs(driver, tokens) == pytest.approx(forward_logprobs(origin, tokens), abs=1e-6)
    # The sampler serves the imported weights version as the trainer computes it.
    sampler.wait_loaded({f"ten/imported@v{imported.weights_version}"})
    served_as_trained(sampler, driver, imported.weights_version)

    # One step trains it: the loss is finite and the params move.
    before = parse_training_state(trainer.download("ten/imported", imported.state_version)).params
    step = driver.train(DATA)
    assert step.step == 1 and not step.skipped
    after = parse_training_state(trainer.download("ten/imported", driver.save().version)).params
    assert set(after) == set(before)
    assert any(not (after[k] == before[k]).all() for k in before)
