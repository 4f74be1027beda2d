"""End-to-end check of the torchrun launcher: a real registry (embedded Valkey + SeaweedFS), the megatron trainer
under torchrun (rank 0 serves gRPC, the other ranks follow), a client that trains and publishes, then SIGTERM and a
clean exit of every rank.

    python scripts/gpu/launch_check.py --nproc 2 --tp 2 [--nnodes 2] [--cpu-dev]

--cpu-dev runs the ranks on CPU (gloo) through tests/fixtures/megatron_cpu.py; PYTHONPATH must reach megatron-core.
--nnodes N splits the ranks over N torchrun agents that meet through a c10d rendezvous, as N machines would (each
"node" sees only its own GPUs), so one job spans nodes: whichever agent holds global rank 0 serves gRPC.
"""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import grpc

from loraplane.adapter_format import parse_adapter
from loraplane.config import Settings
from loraplane.local.processes import free_port, seaweed_s3_server, valkey_server
from loraplane.rpc import BackgroundLoop, channel_options
from loraplane.v1 import common_pb2, trainer_pb2, trainer_pb2_grpc
from registry_svc.server import start_registry_server

REPO = Path(__file__).resolve().parents[2]
CPU_ENTRY = "import tests.fixtures.megatron_cpu; from trainer_svc.torchrun import main; main()"


def tp_friendly_model(directory: Path) -> Path:
    """A seeded tiny Llama directory whose vocabulary (256) and KV heads (2) split over 2 ranks (the `tiny` model's
    261-token vocabulary does not)."""
    from loraplane.models.tiny import build_tiny_tokenizer, build_tp_divisible_llama

    build_tp_divisible_llama(11).save_pretrained(directory)
    build_tiny_tokenizer().save_pretrained(directory)
    return directory


def rank_zero_pid(launcher: int) -> int | None:
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            env = (entry / "environ").read_bytes().split(b"\0")
        except (OSError, IndexError, ValueError):
            continue
        if ppid == launcher and b"RANK=0" in env:  # the exact variable, not LOCAL_RANK=0 or GROUP_RANK=0
            return int(entry.name)
    return None


def launchers(args, entry: list[str], env: dict) -> list[tuple[list[str], dict]]:
    """One torchrun agent per node: standalone for one node, else a c10d rendezvous on loopback."""
    run = [sys.executable, "-m", "torch.distributed.run"]
    if args.nnodes == 1:
        return [(run + ["--standalone", "--nproc-per-node", str(args.nproc)] + entry, env)]
    per_node, rdzv = args.nproc // args.nnodes, f"127.0.0.1:{free_port()}"
    out = []
    for node in range(args.nnodes):
        node_env = dict(env)
        if not args.cpu_dev:
            node_env["CUDA_VISIBLE_DEVICES"] = ",".join(str(node * per_node + i) for i in range(per_node))
        out.append((run + ["--nnodes", str(args.nnodes), "--nproc-per-node", str(per_node), "--rdzv-backend", "c10d",
                           "--rdzv-endpoint", rdzv, "--rdzv-id", "launch-check"] + entry, node_env))
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--nproc", type=int, default=2)
    ap.add_argument("--tp", type=int, default=2)
    ap.add_argument("--nnodes", type=int, default=1)
    ap.add_argument("--cpu-dev", action="store_true")
    args = ap.parse_args()
    if args.nproc % args.nnodes:
        raise SystemExit("--nproc must be a multiple of --nnodes")
    root = Path(tempfile.mkdtemp(prefix="launch-check-"))
    base_model = "tiny" if args.tp == 1 else str(tp_friendly_model(root / "model"))
    valkey, seaweed = valkey_server(root / "valkey"), seaweed_s3_server(root / "seaweed")
    valkey.start()
    seaweed.start()
    loop = BackgroundLoop()
    settings = Settings(redis_url=valkey.url, s3_endpoint=seaweed.endpoint, s3_access_key=seaweed.access_key,
                        s3_secret_key=seaweed.secret_key, s3_bucket="launch-check")
    registry = loop.run(start_registry_server(settings, host="127.0.0.1", port=0), timeout=60)
    port = free_port()
    entry = ["--no-python", sys.executable, "-c", CPU_ENTRY] if args.cpu_dev else [
        "-m", "trainer_svc.torchrun"]
    entry += ["--base-model", base_model, "--tensor-parallel-size", str(args.tp), "--device-slots", "2",
              "--registry-address", registry.address, "--host", "127.0.0.1", "--port", str(port)]
    if args.cpu_dev:
        entry += ["--dtype", "float32"]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]))
    log_path = root / "trainer.log"
    log = open(log_path, "w")  # noqa: SIM115 (the trainer processes write to it until the finally block)
    procs = [subprocess.Popen(cmd, cwd=REPO, env=node_env, stdout=log, stderr=subprocess.STDOUT,
                              start_new_session=True) for cmd, node_env in launchers(args, entry, env)]
    try:
        deadline = time.time() + 300
        while "TRAINER_READY" not in log_path.read_text(errors="replace"):
            if any(p.poll() is not None for p in procs):
                sys.stdout.write("".join(l for l in log_path.read_text().splitlines(True) if "arn" not in l)[-6000:])
                raise RuntimeError(f"trainer exited with {[p.poll() for p in procs]}")
            if time.time() > deadline:
                raise TimeoutError("trainer did not start")
            time.sleep(0.5)
        channel = grpc.insecure_channel(f"127.0.0.1:{port}", options=channel_options())
        stub = trainer_pb2_grpc.TrainerServiceStub(channel)
        assert stub.GetInfo(trainer_pb2.GetInfoRequest()).backend == "megatron"
        for i, name in enumerate(("lc-a", "lc-b", "lc-c")):
            stub.CreateAdapter(trainer_pb2.TrainerServiceCreateAdapterRequest(
                name=name, lora_config=common_pb2.LoraConfig(rank=4, alpha=8.0, seed=i)))
        datum = trainer_pb2.Datum(input_tokens=list(range(10, 30)), target_tokens=list(range(11, 31)))
        for name in ("lc-a", "lc-b", "lc-c"):
            for seq in (1, 3):
                stub.ForwardBackward(trainer_pb2.ForwardBackwardRequest(adapter=name, seq_id=seq, data=[datum]))
                out = stub.OptimStep(trainer_pb2.OptimStepRequest(
                    adapter=name, seq_id=seq + 1, adam_params=trainer_pb2.AdamParams(
                        learning_rate=0.01, beta1=0.9, beta2=0.95, eps=1e-8)))
            assert out.step == 2 and out.grad_norm > 0, (name, out)
        version = stub.PublishWeights(trainer_pb2.PublishWeightsRequest(adapter="lc-a", seq_id=5)).version

        async def blob():
            from loraplane.registry_client import RegistryClient

            client = RegistryClient(registry.address)
            try:
                return (await client.download("lc-a", version=version.version))[1]
            finally:
                await client.close()

        params, spec, _ = parse_adapter(loop.run(blob(), timeout=60))
        assert spec.rank == 4 and any(v.abs().max() > 0 for k, v in params.items() if "lora_B" in k)
        nodes = f" on {args.nnodes} nodes" if args.nnodes > 1 else ""
        print(f"OK: {args.nproc} ranks{nodes}, TP={args.tp}: trained 3 adapters on 2 slots, published v{version.version}")
        channel.close()
    finally:
        if all(p.poll() is None for p in procs):
            # SIGTERM to rank 0 only: it stops serving and releases the followers; every rank must exit 0.
            rank0 = next((pid for p in procs if (pid := rank_zero_pid(p.pid))), None)
            if rank0:
                os.kill(rank0, signal.SIGTERM)
            else:
                for p in procs:
                    os.killpg(p.pid, signal.SIGTERM)
        codes = []
        for p in procs:
            try:
                codes.append(p.wait(timeout=60))
            except subprocess.TimeoutExpired:
                os.killpg(p.pid, signal.SIGKILL)
                codes.append("killed: did not exit on SIGTERM")
        print("trainer exit code", codes[0] if len(codes) == 1 else codes)
        if any(c != 0 for c in codes):
            sys.stdout.write(log_path.read_text(errors="replace")[-3000:])
        log.close()
        loop.run(registry.stop(), timeout=30)
        loop.close()
        seaweed.stop()
        valkey.stop()


if __name__ == "__main__":
    main()
