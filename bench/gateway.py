"""The gateway's added latency: the same forward_backward and sample through the HTTP gateway vs straight to the
gRPC services, alternating call by call in one run on one machine.

Everything runs as real processes on loopback (`loraplane up`'s local cluster: Valkey, SeaweedFS, registry,
trainer, sampler, gateway). Four ways per operation, interleaved:
  grpc        the trainer / sampler stub, one blocking gRPC call (what loraplane.client does underneath)
  gateway     the Tinker wire protocol over HTTP by hand: submit (protobuf / JSON), then retrieve_future
  tinker_sdk  the official tinker SDK (0.38) against the gateway, `.result()` on each future
  lp_client   loraplane's own client SDK against the gRPC services
`gateway - grpc` is the gateway's overhead; `tinker_sdk - lp_client` is what a user sees switching SDKs.

    .venv/bin/python bench/gateway.py [--model tiny] [--iterations 100]
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import grpc
import httpx
import numpy as np

from bench.common import environment, latency_summary, print_table, write_results
from loraplane.config import Settings
from loraplane.rpc import channel_options
from loraplane.v1 import common_pb2, sampler_pb2, sampler_pb2_grpc, trainer_pb2, trainer_pb2_grpc
from loraplane_cli.local_cluster import start_cluster, stop_cluster


def proto_fwdbwd(model_id: str, seq_id: int, tokens: list[int]) -> bytes:
    from gateway_svc.wire import tinker_wire_pb2 as wire

    datum = wire.Datum(model_input=[wire.Chunk(encoded_text=wire.EncodedTextChunk(
        tokens=np.asarray(tokens[:-1], "<i4").tobytes()))])
    datum.loss_fn_inputs["target_tokens"].CopyFrom(wire.Tensor(dense=np.asarray(tokens[1:], "<i8").tobytes(),
                                                               dtype=wire.DTYPE_INT64, shape=[len(tokens) - 1]))
    return wire.ForwardBackwardRequest(model_id=model_id, seq_id=seq_id, data=[datum],
                                       loss_fn="cross_entropy").SerializeToString()


def run(model: str, iterations: int, seq_len: int, max_tokens: int, workdir: Path) -> dict:
    import tinker
    from tinker import types

    import loraplane.client as lp

    settings = Settings(data_dir=workdir, base_model=model)
    state, _started = start_cluster(settings, extra_env={"LORAPLANE_BASE_MODEL": model, "TINKER_TELEMETRY": "0"},
                                    gateway=True)
    try:
        addresses = state.addresses()
        base_url = state.component("gateway").endpoint
        trainer = trainer_pb2_grpc.TrainerServiceStub(grpc.insecure_channel(addresses["trainer"],
                                                                            options=channel_options()))
        sampler = sampler_pb2_grpc.SamplerServiceStub(grpc.insecure_channel(addresses["sampler"],
                                                                            options=channel_options()))
        rng = random.Random(0)
        tokens = [rng.randrange(5, 200) for _ in range(seq_len + 1)]
        prompt = tokens[:16]

        # grpc: our own adapter, driven with consecutive seq_ids.
        trainer.CreateAdapter(trainer_pb2.TrainerServiceCreateAdapterRequest(
            name="bench/direct", lora_config=common_pb2.LoraConfig(rank=8)))
        grpc_datum = trainer_pb2.Datum(input_tokens=tokens[:-1], target_tokens=tokens[1:])
        grpc_seq = 0

        # gateway (by hand): a session and model through the wire API.
        http = httpx.Client(base_url=base_url + "/api/v1", timeout=60)
        session = http.post("/create_session", json={"tags": [], "type": "create_session"}).json()["session_id"]
        created = http.post("/create_model", json={"session_id": session, "model_seq_id": 0, "base_model": model,
                                                   "lora_config": {"rank": 8}, "type": "create_model"}).json()
        http.post("/retrieve_future", json={"request_id": created["request_id"]})
        model_id, wire_seq = created["model_id"], 0
        sampler_id = http.post("/create_sampling_session", json={
            "session_id": session, "sampling_session_seq_id": 0, "base_model": model}).json()["sampling_session_id"]
        sample_seq = 0

        service = tinker.ServiceClient(base_url=base_url, api_key="tml-bench")
        training = service.create_lora_training_client(base_model=model, rank=8).result()
        sampling = service.create_sampling_client(base_model=model).result()
        sdk_datum = types.Datum(model_input=types.ModelInput.from_ints(tokens[:-1]),
                                loss_fn_inputs={"target_tokens": tokens[1:]})
        params = types.SamplingParams(max_tokens=max_tokens, temperature=0.0, seed=1)

        lp_service = lp.ServiceClient(trainer=addresses["trainer"], sampler=addresses["sampler"],
                                      registry=addresses["registry"])
        lp_training = lp_service.create_lora_training_client(model, rank=8, name="bench/lp-client")
        lp_sampling = lp_service.create_sampling_client()
        lp_datum = lp.datum_from_sequence(tokens)
        lp_params = lp.SamplingParams(max_tokens=max_tokens, temperature=0.0, seed=1)

        def fb_grpc():
            nonlocal grpc_seq
            grpc_seq += 1
            trainer.ForwardBackward(trainer_pb2.ForwardBackwardRequest(
                adapter="bench/direct", seq_id=grpc_seq, data=[grpc_datum], loss_fn="cross_entropy"))

        def fb_gateway():
            nonlocal wire_seq
            wire_seq += 1
            accepted = http.post("/forward_backward", content=proto_fwdbwd(model_id, wire_seq, tokens),
                                 headers={"content-type": "application/x-protobuf"}).json()
            reply = http.post("/retrieve_future", json={"request_id": accepted["request_id"]},
                              headers={"accept": "application/x-protobuf"})
            assert reply.headers["content-type"] == "application/x-protobuf", reply.text

        def fb_sdk():
            training.forward_backward([sdk_datum], "cross_entropy").result()

        def fb_lp():
            lp_training.forward_backward([lp_datum], "cross_entropy").result()

        def sample_grpc():
            sampler.Sample(sampler_pb2.SampleRequest(
                prompt_tokens=prompt, num_samples=1, sampling_params=common_pb2.SamplingParams(
                    max_tokens=max_tokens, temperature=0.0, seed=1)))

        def sample_gateway():
            nonlocal sample_seq
            sample_seq += 1
            accepted = http.post("/asample", json={
                "sampling_session_id": sampler_id, "seq_id": sample_seq, "num_samples": 1, "type": "sample",
                "prompt": {"chunks": [{"type": "encoded_text", "tokens": prompt}]},
                "sampling_params": {"max_tokens": max_tokens, "temperature": 0.0, "seed": 1}}).json()
            reply = http.post("/retrieve_future", json={"request_id": accepted["request_id"]})
            assert reply.headers["content-type"] == "application/x-protobuf", reply.text

        def sample_sdk():
            sampling.sample(types.ModelInput.from_ints(prompt), 1, params).result()

        def sample_lp():
            lp_sampling.sample(lp.ModelInput.from_ints(prompt), 1, lp_params).result()

        ways = {"forward_backward": {"grpc": fb_grpc, "gateway": fb_gateway, "tinker_sdk": fb_sdk,
                                     "lp_client": fb_lp},
                "sample": {"grpc": sample_grpc, "gateway": sample_gateway, "tinker_sdk": sample_sdk,
                           "lp_client": sample_lp}}
        results: dict = {}
        for op, fns in ways.items():
            for fn in fns.values():  # warm-up: channels, connections, first-call allocations
                for _ in range(3):
                    fn()
            timings: dict[str, list[float]] = {name: [] for name in fns}
            for i in range(iterations):
                order = list(fns.items())
                order = order[i % len(order):] + order[:i % len(order)]  # rotate who goes first
                for name, fn in order:
                    started = time.perf_counter()
                    fn()
                    timings[name].append(time.perf_counter() - started)
            summary = {name: latency_summary(values) for name, values in timings.items()}
            summary["gateway_overhead_p50_ms"] = round(summary["gateway"]["p50_ms"] - summary["grpc"]["p50_ms"], 3)
            summary["sdk_switch_p50_ms"] = round(summary["tinker_sdk"]["p50_ms"] - summary["lp_client"]["p50_ms"], 3)
            results[op] = summary
        service.close("success")
        lp_service.close()
        return results
    finally:
        stop_cluster(state)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default="tiny")
    parser.add_argument("--iterations", type=int, default=100)
    parser.add_argument("--seq-len", type=int, default=64)
    parser.add_argument("--max-tokens", type=int, default=8)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="bench-gateway-") as workdir:
        ops = run(args.model, args.iterations, args.seq_len, args.max_tokens, Path(workdir))
    results = {"benchmark": "gateway", "model": args.model, "seq_len": args.seq_len, "max_tokens": args.max_tokens,
               "iterations": args.iterations, "environment": environment(), "results": ops}
    path = write_results("gateway", results)
    print(json.dumps(results, indent=2))
    rows = []
    for op, summary in ops.items():
        for way in ("grpc", "gateway", "lp_client", "tinker_sdk"):
            s = summary[way]
            rows.append([f"{op} / {way}", s["p50_ms"], s["p90_ms"], s["p99_ms"]])
        rows.append([f"{op} / gateway overhead (p50)", summary["gateway_overhead_p50_ms"], "", ""])
    print_table(f"gateway latency, ms ({args.model}, {args.iterations} alternating iterations)",
                ["path", "p50", "p90", "p99"], rows)
    print(f"results: {path}")


if __name__ == "__main__":
    main()
