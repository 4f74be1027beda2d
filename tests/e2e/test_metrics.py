"""Each service's /metrics endpoint (prometheus-client over real HTTP) after a train → publish → sample loop through
real servers: the RPC counters, latency histograms, per-tenant training tokens and steps, publish and download
bytes, event lag and the sampler's loaded versions moved."""

from __future__ import annotations

import urllib.request

import grpc
import pytest
from prometheus_client.parser import text_string_to_metric_families

from loraplane.v1 import common_pb2, sampler_pb2, trainer_pb2
from tests.fixtures.registry import start_live_registry
from tests.fixtures.sampler import start_live_sampler
from tests.fixtures.trainer import start_live_trainer


def scrape(url: str) -> dict[tuple[str, tuple], float]:
    with urllib.request.urlopen(url, timeout=10) as reply:
        text = reply.read().decode()
    return {(sample.name, tuple(sorted(sample.labels.items()))): sample.value
            for family in text_string_to_metric_families(text) for sample in family.samples}


def value(samples, name: str, **labels) -> float:
    wanted = set(labels.items())
    return sum(v for (n, lab), v in samples.items() if n == name and wanted <= set(lab))


def test_metrics_move_after_train_publish_sample(isolated_settings, background_loop):
    settings = isolated_settings.model_copy(update={"metrics_port": 0})
    registry = start_live_registry(settings, background_loop)
    trainer = start_live_trainer(settings, background_loop, registry.address)
    sampler = start_live_sampler(settings, background_loop, registry.address)
    try:
        urls = {name: live.running.server.metrics.url for name, live in
                (("registry", registry), ("trainer", trainer), ("sampler", sampler))}
        before = {name: scrape(url) for name, url in urls.items()}

        stub = trainer.stub()
        name = "metrics-team/run"
        stub.CreateAdapter(trainer_pb2.TrainerServiceCreateAdapterRequest(
            name=name, lora_config=common_pb2.LoraConfig(rank=4, alpha=8.0)))
        tokens = list(range(10, 30))
        datum = trainer_pb2.Datum(input_tokens=tokens[:-1], target_tokens=tokens[1:])
        stub.ForwardBackward(trainer_pb2.ForwardBackwardRequest(adapter=name, seq_id=1, data=[datum],
                                                                loss_fn="cross_entropy"))
        stub.OptimStep(trainer_pb2.OptimStepRequest(adapter=name, seq_id=2,
                                                    adam_params=trainer_pb2.AdamParams(learning_rate=1e-2)))
        stub.PublishWeights(trainer_pb2.PublishWeightsRequest(adapter=name, seq_id=3))
        sampler.wait_loaded({f"{name}@v1"})
        reply = sampler.stub().Sample(sampler_pb2.SampleRequest(
            adapter=common_pb2.AdapterRef(name=name), prompt_tokens=[5, 6, 7],
            sampling_params=common_pb2.SamplingParams(max_tokens=4)), timeout=30)
        assert reply.served_version == 1

        after = {name_: scrape(url) for name_, url in urls.items()}

        def moved(server: str, metric: str, **labels) -> float:
            return value(after[server], metric, **labels) - value(before[server], metric, **labels)

        tenant = "metrics-team"
        assert moved("trainer", "loraplane_rpc_total", service="TrainerService", method="ForwardBackward",
                     code="OK") >= 1
        assert moved("trainer", "loraplane_rpc_seconds_count", service="TrainerService", method="OptimStep") >= 1
        assert moved("trainer", "loraplane_training_tokens_total", tenant=tenant, kind="forward_backward") == 19
        assert moved("trainer", "loraplane_training_steps_total", tenant=tenant) == 1
        assert value(after["trainer"], "loraplane_trainer_adapters") >= 1
        assert moved("registry", "loraplane_registry_publish_bytes_total", tenant=tenant) > 0
        assert moved("registry", "loraplane_registry_download_bytes_total", tenant=tenant) > 0
        assert moved("registry", "loraplane_registry_event_lag_seconds_count") >= 1
        assert moved("registry", "loraplane_rpc_total", service="AdapterRegistryService", method="PublishVersion",
                     code="OK") >= 1
        assert moved("sampler", "loraplane_sampler_tokens_total", tenant=tenant) == 4
        assert value(after["sampler"], "loraplane_sampler_loaded_versions") >= 1
        assert moved("sampler", "loraplane_rpc_total", service="SamplerService", method="Sample", code="OK") == 1

        # Failures are counted under their status code.
        with pytest.raises(grpc.RpcError):
            stub.ForwardBackward(trainer_pb2.ForwardBackwardRequest(adapter="metrics-team/none", seq_id=1))
        assert value(scrape(urls["trainer"]), "loraplane_rpc_total", method="ForwardBackward", code="NOT_FOUND") >= 1
    finally:
        sampler.close()
        trainer.close()
        registry.close()
