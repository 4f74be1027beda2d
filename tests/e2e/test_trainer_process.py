"""The trainer as its own process (`python -m trainer_svc`), and its behaviour when the registry goes away."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import grpc
import pytest

from loraplane.rpc import channel_options, check_health
from loraplane.v1 import common_pb2, trainer_pb2, trainer_pb2_grpc
from registry_svc.server import start_registry_server
from tests.fixtures.trainer import start_live_trainer

ROOT = Path(__file__).resolve().parents[2]
ADAM = trainer_pb2.AdamParams(learning_rate=1e-4)


def test_python_m_trainer_svc_serves_and_stops_cleanly(registry):
    env = dict(os.environ, LORAPLANE_REGISTRY_ADDRESS=registry.address, PYTHONPATH=str(ROOT))
    proc = subprocess.Popen([sys.executable, "-m", "trainer_svc", "--port", "0", "--base-model", "tiny"],
                            cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    try:
        line = proc.stdout.readline()
        assert line.startswith("TRAINER_READY "), line
        address = line.split()[1]
        assert check_health(address)
        with grpc.insecure_channel(address, options=channel_options()) as channel:
            stub = trainer_pb2_grpc.TrainerServiceStub(channel)
            assert stub.GetInfo(trainer_pb2.GetInfoRequest()).base_model == "tiny"
            stub.CreateAdapter(trainer_pb2.TrainerServiceCreateAdapterRequest(
                name="proc", lora_config=common_pb2.LoraConfig(rank=2)))
            version = stub.PublishWeights(trainer_pb2.PublishWeightsRequest(adapter="proc", seq_id=1)).version
            assert version.version == 1
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(30) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)


def test_publish_while_the_registry_is_down_is_unavailable_and_a_retry_publishes_that_snapshot(
        registry, background_loop):
    live = start_live_trainer(registry.settings, background_loop, registry.address)
    port = int(registry.address.rsplit(":", 1)[1])
    try:
        stub = live.stub()
        stub.CreateAdapter(trainer_pb2.TrainerServiceCreateAdapterRequest(
            name="outage", lora_config=common_pb2.LoraConfig(rank=2, seed=4)))
        data = [trainer_pb2.Datum(input_tokens=list(range(10, 30)), target_tokens=list(range(11, 31)))]
        stub.ForwardBackward(trainer_pb2.ForwardBackwardRequest(adapter="outage", seq_id=1, data=data))
        stub.OptimStep(trainer_pb2.OptimStepRequest(adapter="outage", seq_id=2, adam_params=ADAM))
        background_loop.run(registry.running.stop(grace=0.1), timeout=30)
        # Tried: PublishWeights with the registry down (a real outage: the server is stopped).
        request = trainer_pb2.PublishWeightsRequest(adapter="outage", seq_id=3)
        with pytest.raises(grpc.RpcError) as info:
            stub.PublishWeights(request)
        assert info.value.code() == grpc.StatusCode.UNAVAILABLE
        # Training goes on meanwhile; the publish captured the weights at seq 3, before this step.
        stub.ForwardBackward(trainer_pb2.ForwardBackwardRequest(adapter="outage", seq_id=4, data=data))
        assert stub.OptimStep(trainer_pb2.OptimStepRequest(adapter="outage", seq_id=5, adam_params=ADAM)).step == 2
        registry.running = background_loop.run(start_registry_server(registry.settings, port=port), timeout=60)
        deadline = time.monotonic() + 30
        while True:
            try:
                version = stub.PublishWeights(request).version
                break
            except grpc.RpcError as exc:
                assert exc.code() == grpc.StatusCode.UNAVAILABLE and time.monotonic() < deadline
                time.sleep(0.5)
        assert version.version == 1 and version.training_step == 1
        # The retry did not publish twice, and a later publish sees the later step.
        again = stub.PublishWeights(request).version
        assert again.version == 1
        later = stub.PublishWeights(trainer_pb2.PublishWeightsRequest(adapter="outage", seq_id=6)).version
        assert later.version == 2 and later.training_step == 2
    finally:
        live.close()
