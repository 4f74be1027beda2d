"""The torchrun megatron trainer on the `tiny-moe` model (Qwen3-MoE in miniature) with expert parallelism, end to end
on CPU: a real registry (embedded Valkey + SeaweedFS), 2 ranks (EP=2: each holds 4 of the 8 experts of every MoE
layer), gRPC CreateAdapter with expert targets in both layouts, fused ForwardBackward + OptimStep, PublishWeights,
and the published blob is the canonical one: every expert's factors (gathered from both EP ranks) in the shapes the
torch backend gives, and the blob's adapter in the torch backend reproduces the trainer's logprobs.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import grpc
import torch

from loraplane.adapter_format import parse_adapter
from loraplane.config import Settings
from loraplane.local.processes import free_port, seaweed_s3_server, valkey_server
from loraplane.rpc import BackgroundLoop, channel_options
from loraplane.v1 import common_pb2, trainer_pb2, trainer_pb2_grpc
from registry_svc.server import start_registry_server
from scripts.gpu.launch_check import rank_zero_pid

REPO = Path(__file__).resolve().parents[2]
ENTRY = "import tests.fixtures.megatron_cpu; from trainer_svc.torchrun import main; main()"
LAYOUTS = {"per": common_pb2.EXPERT_LORA_LAYOUT_PER_EXPERT, "shared": common_pb2.EXPERT_LORA_LAYOUT_SHARED_OUTER}


def test_expert_parallel_trainer_trains_and_publishes_canonical_expert_adapters():
    from loraplane.lora import expected_shapes
    from loraplane.models import load_base_model
    from trainer_svc.backends.base import BatchItem, DatumInput
    from trainer_svc.backends.torch_backend import TorchBackend
    from trainer_svc.pool import AdapterState

    root = Path(tempfile.mkdtemp(prefix="moe-launch-"))
    valkey, seaweed = valkey_server(root / "valkey"), seaweed_s3_server(root / "seaweed")
    valkey.start()
    seaweed.start()
    loop = BackgroundLoop()
    settings = Settings(redis_url=valkey.url, s3_endpoint=seaweed.endpoint, s3_access_key=seaweed.access_key,
                        s3_secret_key=seaweed.secret_key, s3_bucket="moe-launch")
    registry = loop.run(start_registry_server(settings, host="127.0.0.1", port=0), timeout=60)
    port = free_port()
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", "--no-python",
           sys.executable, "-c", ENTRY, "--base-model", "tiny-moe", "--tensor-parallel-size", "1",
           "--expert-parallel-size", "2", "--device-slots", "2", "--dtype", "float32", "--registry-address",
           registry.address, "--host", "127.0.0.1", "--port", str(port)]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]),
               OMP_NUM_THREADS="1")
    log_path = root / "trainer.log"
    with open(log_path, "w") as log:
        proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        deadline = time.time() + 240
        while "TRAINER_READY" not in log_path.read_text(errors="replace"):
            assert proc.poll() is None, log_path.read_text(errors="replace")[-4000:]
            assert time.time() < deadline, "trainer did not start"
            time.sleep(0.5)
        channel = grpc.insecure_channel(f"127.0.0.1:{port}", options=channel_options())
        stub = trainer_pb2_grpc.TrainerServiceStub(channel)
        for name, layout in LAYOUTS.items():
            stub.CreateAdapter(trainer_pb2.TrainerServiceCreateAdapterRequest(
                name=name, lora_config=common_pb2.LoraConfig(rank=4, alpha=8.0, seed=3, expert_layout=layout)))
        g = torch.Generator().manual_seed(5)
        tokens = [torch.randint(5, 250, (n + 1,), generator=g).tolist() for n in (13, 9, 6)]
        data = [trainer_pb2.Datum(input_tokens=t[:-1], target_tokens=t[1:]) for t in tokens]
        losses = {name: [] for name in LAYOUTS}
        for step in range(3):
            # Both adapters' requests in flight together: the scheduler may fuse them into one batch.
            futures = [stub.ForwardBackward.future(trainer_pb2.ForwardBackwardRequest(
                adapter=name, seq_id=2 * step + 1, data=data)) for name in LAYOUTS]
            for name, future in zip(LAYOUTS, futures, strict=True):
                losses[name].append(future.result().metrics["loss:sum"])
            for name in LAYOUTS:
                out = stub.OptimStep(trainer_pb2.OptimStepRequest(adapter=name, seq_id=2 * step + 2,
                                                                  adam_params=trainer_pb2.AdamParams(
                                                                      learning_rate=0.02, beta1=0.9, beta2=0.95,
                                                                      eps=1e-8)))
                assert out.step == step + 1 and out.grad_norm > 0
        final = {name: stub.ForwardBackward(trainer_pb2.ForwardBackwardRequest(adapter=name, seq_id=7, data=data))
                 for name in LAYOUTS}
        versions = {name: stub.PublishWeights(trainer_pb2.PublishWeightsRequest(adapter=name, seq_id=8)).version
                    for name in LAYOUTS}

        async def download(name: str, version: int) -> bytes:
            from loraplane.registry_client import RegistryClient

            client = RegistryClient(registry.address)
            try:
                return (await client.download(name, version=version))[1]
            finally:
                await client.close()

        blobs = {name: loop.run(download(name, v.version), timeout=60) for name, v in versions.items()}
        channel.close()
    finally:
        if proc.poll() is None:
            # SIGTERM to rank 0 only: it stops serving and releases the other rank (as scripts/gpu/launch_check.py).
            rank0 = rank_zero_pid(proc.pid)
            os.kill(rank0, signal.SIGTERM) if rank0 else os.killpg(proc.pid, signal.SIGTERM)
        try:
            code = proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            code = "killed"
        loop.run(registry.stop(), timeout=30)
        loop.close()
        seaweed.kill()  # its data is thrown away; `weed server` sits out a 10 s grace after SIGTERM
        valkey.stop()
    assert code == 0, (code, log_path.read_text(errors="replace")[-3000:])  # every rank exited cleanly

    base = load_base_model("tiny-moe", device="cpu", dtype=torch.float32)
    torch_backend = TorchBackend(base)
    for name in LAYOUTS:
        assert losses[name][-1] < losses[name][0], losses[name]  # it learns
        params, spec, _ = parse_adapter(blobs[name])
        assert spec.expert_layout == ("per_expert" if name == "per" else "shared_outer")
        assert {k: tuple(v.shape) for k, v in params.items()} == expected_shapes(base, spec)
        expert_b = [v for k, v in params.items() if "experts" in k and "lora_B" in k]
        assert expert_b and all(v.abs().max() > 0 for v in expert_b)  # trained, on both EP ranks' experts
        # The published adapter in the torch backend gives the trainer's logprobs of the last forward.
        p = {k: v.clone().requires_grad_(True) for k, v in params.items()}
        batch = [DatumInput(torch.tensor(t[:-1]), torch.tensor(t[1:])) for t in tokens]
        (res,) = torch_backend.run([BatchItem(AdapterState(name, spec, "tiny-moe", p, {}, {}), batch,
                                              "cross_entropy", {})], backward=False)
        want = torch.tensor([lp for o in final[name].outputs for lp in o.logprobs])
        got = torch.tensor([lp for o in res.outputs for lp in o.logprobs])
        assert (got - want).abs().max() <= 2e-5, (name, (got - want).abs().max())
