"""Compact expert adapters end to end on CPU (issue 34 item 2): a real trainer and a real torch-engine sampler of one
sampler fleet on `tiny-moe`, on a real registry (Valkey + SeaweedFS), all on loopback. A shared-outer adapter's
published version is compact (format "2", its shared factors once) in the registry and in the trainer's in-memory
push, and the sampler serves it with the trainer's logprobs; a blob written the old, expanded way (format "1") still
publishes and serves the same; and its Tinker-layout export imports as a new adapter that a trainer loads, computes
the same logprobs with, and trains."""

from __future__ import annotations

import json

import pytest
import torch

from loraplane.adapter_format import (
    COMPACT_FORMAT,
    FORMAT_VERSION_KEY,
    MODEL_TYPE_KEY,
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
    # The trainer wrote exactly the compact file (its adapter config also names the base model's family).
    assert json.loads(blob_metadata(blob)["adapter_config"])[MODEL_TYPE_KEY] == "qwen3_moe"
    assert blob == serialize_adapter(params, spec, base_name, model_type="qwen3_moe")
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


def test_the_cli_exports_and_imports_and_refuses_a_foreign_key(registry, sampler_blob, tmp_path):
    """`loraplane adapters export --format tinker|peft` and `adapters import` against a live registry; an adapter
    directory with a key loraplane cannot train is refused naming it, and nothing is created."""
    from safetensors.torch import load_file, save_file
    from typer.testing import CliRunner

    from loraplane.registry_client import RegistryClient, lora_config
    from loraplane_cli.app import app

    blob, spec = sampler_blob
    address = ["--registry", registry.address]

    async def setup(client: RegistryClient):
        await client.create_adapter("cli/so", base_model="tiny-moe", lora_config=lora_config(
            spec.rank, spec.effective_alpha, spec.target_modules, spec.seed, "float32", spec.expert_layout))
        return await client.publish("cli/so", blob)

    async def call(make):
        async with RegistryClient(registry.address) as client:
            return await make(client)

    assert registry.loop.run(call(setup)).version == 1
    runner = CliRunner()
    for fmt in ("tinker", "peft"):
        done = runner.invoke(app, ["adapters", "export", "cli/so", str(tmp_path / fmt), "--format", fmt, *address])
        assert done.exit_code == 0, done.output
    tinker_keys = set(load_file(str(tmp_path / "tinker" / "adapter_model.safetensors")))
    assert any(".experts.w2.lora_B." in k for k in tinker_keys)
    assert any(".experts.base_layer.lora_A." in k
               for k in load_file(str(tmp_path / "peft" / "adapter_model.safetensors")))

    done = runner.invoke(app, ["adapters", "import", str(tmp_path / "tinker"), "--name", "cli/back", *address])
    assert done.exit_code == 0, done.output
    assert "shared_outer" in done.output
    back = registry.loop.run(call(lambda c: c.download("cli/back", version=2)))[1]
    params, back_spec, _ = parse_adapter(back)
    assert back_spec == spec and back == serialize_adapter(params, spec, "tiny-moe")
    assert all(torch.equal(params[k], v) for k, v in parse_adapter(blob)[0].items())

    tensors = load_file(str(tmp_path / "tinker" / "adapter_model.safetensors"))
    unembed = "base_model.model.model.unembed_tokens.lora_A.weight"
    save_file({**tensors, unembed: torch.zeros(4, 64)}, str(tmp_path / "tinker" / "adapter_model.safetensors"))
    refused = runner.invoke(app, ["adapters", "import", str(tmp_path / "tinker"), "--name", "cli/bad", *address])
    assert refused.exit_code == 1 and unembed in refused.output.replace("\n", "")
    names = registry.loop.run(call(lambda c: c.list_adapters()))
    assert "cli/bad" not in {a.name for a in names}


@pytest.fixture(scope="module")
def sampler_blob():
    """A trained-looking shared-outer `tiny-moe` adapter's compact weights blob, and its spec."""
    from loraplane.lora import LoraSpec, init_lora_params
    from loraplane.models import load_base_model

    base = load_base_model("tiny-moe")
    spec = LoraSpec.create(4, 8, (), 3, available=tuple(base.module_dims), expert_layout="shared_outer")
    params = init_lora_params(base, spec)
    generator = torch.Generator().manual_seed(9)
    for key, tensor in params.items():
        if key.endswith("lora_B.weight"):
            tensor.copy_(torch.randn(tensor.shape, generator=generator) * 0.2)
    return serialize_adapter(params, spec, "tiny-moe"), spec
