"""What authentication and TLS cost per RPC: the registry's GetAdapter (a small unary call that reads Redis) against
three registries on the same Valkey, alternating rounds in one run: open mode (what a user runs today), API keys
(interceptor + namespace check), API keys over TLS. Ratios are per-call latency against the open mode.

    python bench/auth_overhead.py            # 10 rounds x 300 calls per mode
    python bench/auth_overhead.py --quick
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.common import environment, latency_summary, print_table, write_results
from loraplane.auth import KeyStore
from loraplane.config import Settings
from loraplane.local.processes import seaweed_s3_server, valkey_server
from loraplane.local.tls import make_local_pki
from loraplane.rpc import BackgroundLoop, ClientSecurity, sync_channel
from loraplane.v1 import common_pb2, registry_pb2, registry_pb2_grpc
from registry_svc.server import start_registry_server


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args()
    rounds, calls = (3, 100) if args.quick else (10, 300)
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        valkey, s3 = valkey_server(root / "valkey"), seaweed_s3_server(root / "seaweed")
        valkey.start()
        s3.start()
        loop = BackgroundLoop("bench-auth")
        pki = make_local_pki(root / "pki")
        base = Settings(redis_url=valkey.url, s3_endpoint=s3.endpoint, s3_access_key=s3.access_key,
                        s3_secret_key=s3.secret_key, s3_bucket="bench-auth", key_prefix="bench:")
        running = []
        try:
            async def issue():
                store = KeyStore(valkey.url, "bench:")
                try:
                    return (await store.create_key("acme", "tenant"))[1]
                finally:
                    await store.close()

            token = loop.run(issue())
            configs = {
                "open": (base, ClientSecurity()),
                "auth": (base.model_copy(update={"auth": True}), ClientSecurity(api_key=token)),
                "auth+tls": (base.model_copy(update={"auth": True, "tls_cert": str(pki.server_cert),
                                                     "tls_key": str(pki.server_key)}),
                             ClientSecurity(api_key=token, tls=True, ca=pki.ca.read_bytes())),
            }
            stubs = {}
            for mode, (settings, security) in configs.items():
                server = loop.run(start_registry_server(settings), timeout=60)
                running.append(server)
                stubs[mode] = registry_pb2_grpc.AdapterRegistryServiceStub(sync_channel(server.address, security))
            stubs["open"].CreateAdapter(registry_pb2.CreateAdapterRequest(adapter=registry_pb2.Adapter(
                name="acme/bench", lora_config=common_pb2.LoraConfig(rank=4, alpha=8.0), base_model="tiny")))
            request = registry_pb2.GetAdapterRequest(name="acme/bench")
            samples: dict[str, list[float]] = {mode: [] for mode in configs}
            for stub in stubs.values():  # warm up connections and caches
                for _ in range(20):
                    stub.GetAdapter(request)
            for _ in range(rounds):
                for mode, stub in stubs.items():
                    for _ in range(calls):
                        started = time.perf_counter()
                        stub.GetAdapter(request)
                        samples[mode].append(time.perf_counter() - started)
            summary = {mode: latency_summary(values) for mode, values in samples.items()}
            baseline = summary["open"]["p50_ms"]
            rows = [(mode, f"{s['p50_ms']:.3f}", f"{s['p90_ms']:.3f}", f"{s['p99_ms']:.3f}",
                     f"{s['p50_ms'] / baseline:.2f}x") for mode, s in summary.items()]
            print_table(f"GetAdapter latency, {rounds} alternating rounds x {calls} calls",
                        ["mode", "p50 ms", "p90 ms", "p99 ms", "p50 vs open"], rows)
            write_results("auth_overhead", {"environment": environment(), "rounds": rounds, "calls": calls,
                                            "latency": summary})
        finally:
            for server in running:
                loop.run(server.stop(grace=0.5), timeout=30)
            loop.close()
            s3.stop()
            valkey.stop()


if __name__ == "__main__":
    main()
