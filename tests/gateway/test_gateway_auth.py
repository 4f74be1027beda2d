"""The gateway in front of services with authentication on: each caller's loraplane key (as the Tinker SDK's
`TINKER_API_KEY=tml-<key>`, or an OpenAI / Anthropic client's key) decides its tenant; the gateway calls the
services with its own service key acting for that tenant, so a tenant's Tinker models become `<tenant>/...`
adapters and another tenant can neither see nor use them. Tried: no key, an unknown key, a revoked key, two
tenants' keys against each other's models, checkpoints and sampler paths."""

from __future__ import annotations

import random
import uuid

import anthropic
import httpx
import openai
import pytest
import tinker
from tinker import types

from gateway_svc.config import GatewaySettings
from loraplane.config import Settings
from tests.contract.auth_helpers import auth_settings, issue_standard_keys
from tests.fixtures.registry import start_live_registry
from tests.fixtures.sampler import start_live_sampler
from tests.fixtures.trainer import start_live_trainer
from tests.gateway.conftest import LiveGateway, free_port


@pytest.fixture(scope="module")
def secured(valkey, seaweed, background_loop, tmp_path_factory):
    suffix = uuid.uuid4().hex[:10]
    settings = auth_settings(Settings(
        redis_url=valkey.url, s3_endpoint=seaweed.endpoint, s3_access_key=seaweed.access_key,
        s3_secret_key=seaweed.secret_key, s3_bucket=f"lp-gwauth-{suffix}", key_prefix=f"lpgwa{suffix}:",
        base_model="tiny"))
    keys = issue_standard_keys(settings, background_loop)
    service = auth_settings(settings, api_key=keys.tokens["service"])
    registry = start_live_registry(settings, background_loop)
    trainer = start_live_trainer(service, background_loop, registry.address, gap_timeout_s=5.0)
    sampler = start_live_sampler(service, background_loop, registry.address)
    gateway_settings = GatewaySettings(
        port=free_port(), trainer_address=trainer.address, registry_address=registry.address,
        sampler_address=sampler.address, redis_url=valkey.url, key_prefix=f"lpgwa{suffix}:gw:",
        tokenizer_dir=str(tmp_path_factory.mktemp("gateway-auth-tokenizers")), long_poll_s=5.0, future_lease_s=3.0)
    gateway = LiveGateway(gateway_settings, cluster=service).start()
    try:
        yield gateway, keys, trainer
    finally:
        gateway.stop()
        sampler.close()
        trainer.close()
        keys.close()
        registry.close()


def tinker_client(gateway, key: str) -> tinker.ServiceClient:
    return tinker.ServiceClient(base_url=gateway.base_url, api_key=f"tml-{key}")


def datum(seed: int) -> types.Datum:
    tokens = [random.Random(seed).randrange(5, 200) for _ in range(13)]
    return types.Datum(model_input=types.ModelInput.from_ints(tokens[:-1]),
                       loss_fn_inputs={"target_tokens": tokens[1:]})


def test_requests_without_a_valid_key_are_refused_in_each_apis_own_shape(secured):
    gateway, keys, _trainer = secured
    for headers in ({}, {"X-API-Key": "tml-local"}, {"X-API-Key": f"tml-{keys.tokens['revoked']}"}):
        reply = httpx.post(f"{gateway.base_url}/api/v1/create_session", json={"tags": []}, headers=headers)
        assert reply.status_code == 401, (headers, reply.text)
        assert reply.json()["category"] == "user" and "key" in reply.json()["error"]
    # The health probe needs no key.
    assert httpx.get(f"{gateway.base_url}/api/v1/healthz").status_code == 200
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=gateway.base_url + "/v1", api_key="sk-nothing", max_retries=0).models.list()
    with pytest.raises(anthropic.AuthenticationError):
        anthropic.Anthropic(base_url=gateway.base_url, api_key="nothing", max_retries=0).messages.create(
            model="tiny", max_tokens=2, messages=[{"role": "user", "content": "hi"}])


def test_each_tenant_trains_in_its_own_namespace_and_cannot_reach_the_others(secured):
    gateway, keys, trainer = secured
    acme, globex = tinker_client(gateway, keys.tokens["own"]), tinker_client(gateway, keys.tokens["other"])
    try:
        training = acme.create_lora_training_client(base_model="tiny", rank=4, seed=3).result()
        training.forward_backward([datum(1), datum(2)], "cross_entropy").result()
        training.optim_step(types.AdamParams(learning_rate=1e-2)).result()
        saved = training.save_weights_for_sampler("first").result()
        reply = acme.create_sampling_client(model_path=saved.path).sample(
            types.ModelInput.from_ints([5, 6, 7]), 1, types.SamplingParams(max_tokens=3, seed=5)).result()
        assert len(reply.sequences[0].tokens) == 3 or reply.sequences[0].stop_reason == "stop"
        # The trainer holds the model as an adapter of acme's namespace, trained on acme's behalf.
        adapters = list(trainer.service.pool.names())
        assert [a for a in adapters if a.startswith("acme/")], adapters
        acme_rest = acme.create_rest_client()
        run = acme_rest.get_training_run(training.model_id).result()
        assert run.model_owner == "acme"

        # globex sees none of it: not in its listings, and acme's paths and model ids are unknown to it.
        globex_rest = globex.create_rest_client()
        runs = globex_rest.list_training_runs().result().training_runs
        assert training.model_id not in [r.training_run_id for r in runs]
        assert saved.path not in [c.tinker_path for c in globex_rest.list_user_checkpoints().result().checkpoints]
        with pytest.raises(tinker.NotFoundError):
            globex_rest.get_training_run(training.model_id).result()
        with pytest.raises(tinker.NotFoundError):
            globex.create_sampling_client(model_path=saved.path).sample(
                types.ModelInput.from_ints([5, 6, 7]), 1, types.SamplingParams(max_tokens=3)).result()
        adapter = next(a for a in adapters if a.startswith("acme/"))
        oai = openai.OpenAI(base_url=gateway.base_url + "/v1", api_key=keys.tokens["other"], max_retries=0)
        with pytest.raises((openai.PermissionDeniedError, openai.NotFoundError)):
            oai.completions.create(model=adapter, prompt="hello", max_tokens=2)
        assert adapter not in [m.id for m in oai.models.list().data]
        # The owner reaches its adapter through the OpenAI API too.
        mine = openai.OpenAI(base_url=gateway.base_url + "/v1", api_key=keys.tokens["own"], max_retries=0)
        assert mine.completions.create(model=adapter, prompt="hello", max_tokens=2).choices
    finally:
        acme.close("success")
        globex.close("success")
