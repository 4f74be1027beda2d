"""Chaos soak: two tenants train, publish and sample through the Python client on a supervised local cluster while
the trainer, sampler, registry, Valkey and SeaweedFS are SIGKILLed at random moments (the supervisor restarts
them). At the end each adapter's training state must equal, bit for bit, that of the same loop run on servers
nobody killed, and every version whose publish was acknowledged must still exist and serve samples.

Marked slow (a few minutes on two cores): `make test-slow`, or `LORAPLANE_SOAK_S=600 pytest -m slow -k chaos` for
a longer soak. It prints the figures: faults injected, requests tried, lost.
"""

from __future__ import annotations

import asyncio
import os
import random
import signal
import threading
import time

import pytest
import torch

from loraplane.adapter_format import parse_training_state
from loraplane.client import AdamParams, Datum, ModelInput, SamplingParams, ServiceClient
from loraplane.config import Settings
from loraplane.local.state import pid_alive, read_cluster_state
from loraplane.registry_client import RegistryClient
from loraplane_cli.local_cluster import component_health, start_cluster, stop_cluster
from tests.e2e.test_trainer_durability import assert_same_training_state
from tests.fixtures.trainer import start_live_trainer

pytestmark = pytest.mark.slow

VICTIMS = ("trainer", "sampler", "registry", "redis", "s3")
TENANTS = {"acme/soak": 3, "globex/soak": 4}  # adapter -> LoRA seed
PUBLISH_EVERY = 3


def datum(adapter_seed: int, step: int) -> Datum:
    generator = torch.Generator().manual_seed(1000 * adapter_seed + step)
    tokens = torch.randint(5, 261, (17,), generator=generator).tolist()
    return Datum(model_input=ModelInput.from_ints(tokens[:-1]), loss_fn_inputs={"target_tokens": tokens[1:]})


class Tenant:
    """One tenant's loop; the same code drives the chaos cluster and the calm reference."""

    def __init__(self, service: ServiceClient, adapter: str, seed: int, sample: bool):
        self.adapter, self.seed, self.sample = adapter, seed, sample
        self.training = service.create_lora_training_client("tiny", rank=4, alpha=8, seed=seed, name=adapter)
        self.steps = 0
        self.requests = 0
        self.published: list[int] = []

    def run(self, steps: int) -> None:
        for _ in range(steps):
            self.training.forward_backward([datum(self.seed, self.steps), datum(self.seed, self.steps + 500)],
                                           "cross_entropy").result()
            self.training.optim_step(AdamParams(learning_rate=0.02)).result()
            self.steps += 1
            self.requests += 2
            if self.steps % PUBLISH_EVERY == 0:
                sampler = self.training.save_weights_for_sampler().result()
                self.published.append(sampler.version)
                self.requests += 1
                if self.sample:
                    reply = sampler.sample(ModelInput.from_ints([5, 6, 7]), num_samples=1,
                                           sampling_params=SamplingParams(max_tokens=4, seed=1)).result()
                    assert reply.served_version == sampler.version
                    self.requests += 1

    def final_state(self, registry_address: str):
        saved = self.training.save_state().result()
        return download_state(registry_address, self.adapter, saved.version.version)


def download_state(registry_address: str, adapter: str, version: int):
    async def fetch():
        client = RegistryClient(registry_address)
        try:
            return (await client.download(adapter, version))[1]
        finally:
            await client.close()

    return parse_training_state(asyncio.run(fetch()))


class Chaos(threading.Thread):
    """Kills one random process at a random moment, waits until the supervisor has the cluster whole again, and
    repeats until `until`. One fault at a time: each must be survived on its own merits (two dependencies down at
    once only stretch the outage)."""

    def __init__(self, data_dir, seed: int, until: float) -> None:
        super().__init__(daemon=True)
        self.data_dir, self.random, self.until = data_dir, random.Random(seed), until
        self.stop = threading.Event()
        self.faults: list[str] = []

    def run(self) -> None:
        order: list[str] = []
        while not self.stop.wait(self.random.uniform(0.5, 4.0)) and time.monotonic() < self.until:
            if not order:  # every kind of process dies once per round, in a random order
                order = self.random.sample(VICTIMS, len(VICTIMS))
            victim = read_cluster_state(self.data_dir).component(order.pop())
            if pid_alive(victim.pid):
                os.killpg(victim.pid, signal.SIGKILL)
                self.faults.append(victim.name)
            self.wait_whole()

    def wait_whole(self, timeout: float = 180.0) -> None:
        deadline = time.monotonic() + timeout
        while not self.stop.is_set():
            components = read_cluster_state(self.data_dir).components
            if all(component_health(c, str(self.data_dir)) == "healthy" for c in components):
                return
            assert time.monotonic() < deadline, f"the cluster did not come back whole: {components}"
            time.sleep(0.2)


def test_chaos_soak_two_tenants_lose_nothing_while_every_process_is_killed_at_random(tmp_path, registry,
                                                                                       background_loop):
    soak_s = float(os.environ.get("LORAPLANE_SOAK_S", "90"))
    data_dir = tmp_path / "cluster"
    settings = Settings(data_dir=data_dir, base_model="tiny")
    state, _ = start_cluster(settings, extra_env={"LORAPLANE_BASE_MODEL": "tiny"})
    addresses = state.addresses()
    service = ServiceClient(trainer=addresses["trainer"], sampler=addresses["sampler"],
                            registry=addresses["registry"])
    deadline = time.monotonic() + soak_s
    chaos = Chaos(data_dir, seed=int(os.environ.get("LORAPLANE_SOAK_SEED", "7")), until=deadline)
    try:
        tenants = [Tenant(service, adapter, seed, sample=True) for adapter, seed in TENANTS.items()]
        chaos.start()
        failures: list[BaseException] = []

        def loop(tenant: Tenant) -> None:
            try:
                while time.monotonic() < deadline:
                    tenant.run(PUBLISH_EVERY)
            except BaseException as exc:  # noqa: BLE001 - reported below
                failures.append(exc)

        threads = [threading.Thread(target=loop, args=(t,)) for t in tenants]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        chaos.join()
        assert not failures, failures
        chaos.wait_whole()
        chaos_states = {t.adapter: t.final_state(addresses["registry"]) for t in tenants}
        versions = {t.adapter: {v.version for v in service.list_versions(t.adapter)} for t in tenants}
    finally:
        chaos.stop.set()
        stop_cluster(read_cluster_state(data_dir) or state)

    # The calm reference: the same loops, on servers nobody kills.
    calm = start_live_trainer(registry.settings, background_loop, registry.address)
    try:
        reference = ServiceClient(trainer=calm.address, registry=registry.address, sampler="127.0.0.1:1")
        lost = 0
        for tenant in tenants:
            twin = Tenant(reference, tenant.adapter, tenant.seed, sample=False)
            twin.run(tenant.steps)
            want = twin.final_state(registry.address)
            assert_same_training_state(chaos_states[tenant.adapter], want)
            lost += len(set(tenant.published) - versions[tenant.adapter])
            # Acknowledged publishes got consecutive versions: none was applied twice by a retry.
            assert tenant.published == sorted(tenant.published)
            assert len(set(tenant.published)) == len(tenant.published)
    finally:
        calm.close()
    requests = sum(t.requests for t in tenants)
    print(f"\nchaos soak: {soak_s:.0f} s, faults injected {len(chaos.faults)} "
          f"({', '.join(f'{v} {chaos.faults.count(v)}' for v in VICTIMS)}), requests tried {requests}, "
          f"steps {[t.steps for t in tenants]}, versions published {sum(len(t.published) for t in tenants)}, "
          f"lost {lost}")
    assert lost == 0
    assert set(chaos.faults) == set(VICTIMS), chaos.faults
