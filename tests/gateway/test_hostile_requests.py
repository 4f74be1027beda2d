"""Issue 31: what outside test suites and hostile requests found in the gateway, each through the raw Tinker wire
and the official clients (tinker, openai), against a live gateway on real registry, trainer and sampler servers.

- a forward_backward whose target id does not fit int32 failed while the gateway built the gRPC request (category
  `unknown`) without spending its seq_id, so every later request of the model waited for it and failed;
- malformed sampling bodies were 500s (and the connection dropped) or futures failing with category `unknown`;
- Tinker's OpenAI-compatible surface (`/oai/api/v1`, tinker:// sampler paths as `model`) was missing;
- an unseeded LoRA was seeded 0 (every unseeded adapter identical); `/unload_model` was refused;
- `GET /sessions` answered 400; the served model name's tokenizer was not found offline; adapters were created
  with alpha = rank (scale 1) where Tinker's carry alpha 32."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import httpx
import numpy as np
import openai
import pytest
import tinker
from tinker import types

from gateway_svc.wire import tinker_wire_pb2 as wire
from loraplane.v1 import trainer_pb2

PROMPT = {"chunks": [{"type": "encoded_text", "tokens": [5, 6, 7]}]}


@pytest.fixture(scope="module")
def service(cluster):
    client = tinker.ServiceClient(base_url=cluster.base_url)
    yield client
    client.close("success")


class Wire:
    """One kept-alive HTTP connection to the gateway's Tinker API (limits: a single connection, so every request of
    a test goes over the same one unless the server drops it)."""

    def __init__(self, base_url: str):
        self.http = httpx.Client(base_url=base_url + "/api/v1", timeout=60,
                                 limits=httpx.Limits(max_connections=1, max_keepalive_connections=1))

    def local_port(self, reply: httpx.Response) -> int:
        return reply.extensions["network_stream"].get_extra_info("client_addr")[1]

    def post(self, path: str, **kwargs) -> httpx.Response:
        return self.http.post(path, **kwargs)

    def ok(self, path: str, **kwargs) -> dict:
        reply = self.post(path, **kwargs)
        assert reply.status_code == 200, (path, reply.status_code, reply.text)
        return reply.json()

    def future(self, request_id: str) -> dict:
        while True:
            reply = self.post("/retrieve_future", json={"request_id": request_id})
            assert reply.status_code == 200, reply.text
            if reply.headers["content-type"].startswith("application/json"):
                body = reply.json()
                if body.get("type") == "try_again":
                    continue
                return body
            return {"bytes": reply.content}

    def model(self, **lora) -> tuple[str, str]:
        session = self.ok("/create_session", json={"tags": []})["session_id"]
        created = self.ok("/create_model", json={"session_id": session, "model_seq_id": 0, "base_model": "tiny",
                                                 "lora_config": {"rank": 4, **lora}})
        assert "error" not in self.future(created["request_id"])
        return session, created["model_id"]


def fwdbwd_body(model_id: str, seq_id: int, targets: list[int], tokens: list[int] | None = None,
                forward_only: bool = False) -> bytes:
    body = wire.ForwardBackwardRequest(model_id=model_id, seq_id=seq_id, loss_fn="cross_entropy",
                                       forward_only=forward_only)
    d = body.data.add()
    tokens = tokens or [5 + i for i in range(len(targets))]
    d.model_input.add().encoded_text.tokens = np.asarray(tokens, dtype="<i4").tobytes()
    d.loss_fn_inputs["target_tokens"].dense = np.asarray(targets, dtype="<i8").tobytes()
    d.loss_fn_inputs["target_tokens"].dtype = wire.DTYPE_INT64
    d.loss_fn_inputs["target_tokens"].shape.append(len(targets))
    return body.SerializeToString()


PROTO = {"content-type": "application/x-protobuf"}


def test_a_refused_request_spends_its_seq_id_in_every_case(cluster):
    """Before the fix: a target id >= 2^31 failed the future with category `unknown` (ValueError building the gRPC
    Datum) and never reached the trainer, so seq_id 2 waited out the trainer's gap timeout and failed."""
    w = Wire(cluster.base_url)
    _session, model_id = w.model()
    for seq, targets, field in ((1, [6, 7, 2**31], "target_tokens"), (2, [6, 7, 2**40], "target_tokens"),
                                (3, [6, -1, 8], "target_tokens")):
        accepted = w.ok("/forward_backward", content=fwdbwd_body(model_id, seq, targets), headers=PROTO)
        failed = w.future(accepted["request_id"])
        assert failed.get("category") == "user" and field in failed["error"], failed
    # A model_input token the vocabulary lacks: the trainer's own refusal, which spends the seq_id too.
    accepted = w.ok("/forward_backward", content=fwdbwd_body(model_id, 4, [6, 7, 8], tokens=[5, 2**31 - 1, 7]),
                    headers=PROTO)
    assert w.future(accepted["request_id"]).get("category") == "user"
    # Refused optim_steps: a learning rate that is no number, adam_params that are no object.
    for seq, adam in ((5, {"learning_rate": "fast"}), (6, [1e-3])):
        accepted = w.ok("/optim_step", json={"model_id": model_id, "seq_id": seq, "adam_params": adam})
        failed = w.future(accepted["request_id"])
        assert failed.get("category") == "user" and "adam_params" in failed["error"], failed
    # Other payloads the gateway or the trainer refuses, each spending its seq_id.
    hostile = []
    for loss, config, text in (("no-such-loss", {}, None), ("ppo", {"clip_low_threshold": 1e300}, None),
                               ("ppo", {}, "x"), ("cross_entropy", {}, None)):
        body = wire.ForwardBackwardRequest.FromString(fwdbwd_body(model_id, 0, [6, 7, 8]))
        body.loss_fn = loss
        for key, value in config.items():
            body.loss_fn_config_v2[key].number = value
        if text is not None:
            body.loss_fn_config_v2["clip_low_threshold"].text = text
        if loss == "cross_entropy":  # NaN weights, and an image chunk
            w_in = body.data[0].loss_fn_inputs["weights"]
            w_in.dtype, w_in.dense = wire.DTYPE_FLOAT32, np.asarray([1, np.nan, 1], dtype="<f4").tobytes()
            w_in.shape.append(3)
        hostile.append(body)
    image = wire.ForwardBackwardRequest.FromString(fwdbwd_body(model_id, 0, [6, 7, 8]))
    image.data[0].model_input.add().image.data = b"\x89PNG"
    hostile.append(image)
    for seq, body in enumerate(hostile, start=7):
        body.seq_id = seq
        accepted = w.ok("/forward_backward", content=body.SerializeToString(), headers=PROTO)
        failed = w.future(accepted["request_id"])
        assert failed.get("category") == "user", (seq, failed)
    # The model is not wedged: the next seq_ids run at once and succeed.
    accepted = w.ok("/forward_backward", content=fwdbwd_body(model_id, 7 + len(hostile), [6, 7, 8]), headers=PROTO)
    out = w.future(accepted["request_id"])
    assert "bytes" in out, out
    step = w.future(w.ok("/optim_step", json={"model_id": model_id, "seq_id": 8 + len(hostile),
                                              "adam_params": {"learning_rate": 1e-3}})["request_id"])
    assert step.get("type") == "optim_step", step
    adapter = cluster.gateway_settings.default_tenant + "/" + model_id.replace(":train:", "-train-")
    listed = {a.name: a for a in cluster.trainer.stub().ListAdapters(
        trainer_pb2.TrainerServiceListAdaptersRequest(page_size=1000)).adapters}
    assert listed[adapter].last_seq_id == 8 + len(hostile) and listed[adapter].step == 1


# (body change, the field the 400 must name). Before the fix: prompt a list / chunk tokens a number were HTTP 500;
# the rest failed the future with category `unknown`.
MALFORMED = [
    ({"prompt": [5, 6, 7]}, "prompt"),
    ({"prompt": {"chunks": [{"type": "encoded_text", "tokens": 5}]}}, "prompt.chunks.0.tokens"),
    ({"prompt": {"chunks": "abc"}}, "prompt.chunks"),
    ({"prompt": {"chunks": [{"type": "encoded_text", "tokens": [5, 2**31]}]}}, "prompt.chunks.0.tokens.1"),
    ({"prompt": {"chunks": [{"type": "encoded_text", "tokens": [5, -3]}]}}, "prompt.chunks.0.tokens.1"),
    ({"sampling_params": [1, 2]}, "sampling_params"),
    ({"sampling_params": {"max_tokens": -1}}, "sampling_params.max_tokens"),
    ({"sampling_params": {"max_tokens": 2**40}}, "sampling_params.max_tokens"),
    ({"sampling_params": {"max_tokens": "many"}}, "sampling_params.max_tokens"),
    ({"sampling_params": {"seed": -1}}, "sampling_params.seed"),
    ({"sampling_params": {"seed": 2**70}}, "sampling_params.seed"),
    ({"sampling_params": {"top_k": 2**40}}, "sampling_params.top_k"),
    ({"sampling_params": {"temperature": "hot"}}, "sampling_params.temperature"),
    ({"sampling_params": {"stop": [5, 2**33]}}, "sampling_params.stop"),
    ({"sampling_params": {"stop": 5}}, "sampling_params.stop"),
    ({"sampling_params": {"stop": ["a", 5]}}, "sampling_params.stop"),
    ({"num_samples": True}, "num_samples"),
    ({"num_samples": 2**40}, "num_samples"),
    ({"seq_id": 2**70}, "seq_id"),
    ({"topk_prompt_logprobs": -2}, "topk_prompt_logprobs"),
    ({"prompt_logprobs_last_n": 2**40}, "prompt_logprobs_last_n"),
    ({"target_prompt_logprobs": {"data": [2**40, -1], "shape": [2, 1]}}, "target_prompt_logprobs"),
    ({"sampling_session_id": ["x"]}, "sampling_session_id"),
]


def test_malformed_sampling_bodies_are_user_errors_on_a_live_connection(cluster):
    w = Wire(cluster.base_url)
    session = w.ok("/create_session", json={"tags": []})["session_id"]
    sampler = w.ok("/create_sampling_session", json={"session_id": session, "sampling_session_seq_id": 0,
                                                     "base_model": "tiny"})["sampling_session_id"]
    valid = {"sampling_session_id": sampler, "num_samples": 1, "prompt": PROMPT,
             "sampling_params": {"max_tokens": 2, "seed": 1}}
    first = w.post("/asample", json=valid)
    port = w.local_port(first)
    for change, field in MALFORMED:
        reply = w.post("/asample", json={**valid, **change})
        assert reply.status_code == 400, (change, reply.status_code, reply.text)
        body = reply.json()
        assert body["category"] == "user" and field in body["error"], (change, body)
        assert reply.headers["x-should-retry"] == "false"
        # The kept-alive connection survives the refusal: the next valid request goes over the same one.
        after = w.post("/asample", json=valid)
        assert after.status_code == 200 and w.local_port(after) == port, (change, after.text)
        assert "bytes" in w.future(after.json()["request_id"])
    # Not only asample: a body of the wrong shape on the other JSON routes is a 400 naming the field too.
    for path, body, field in (("/create_model", {"session_id": session, "model_seq_id": -1}, "model_seq_id"),
                              ("/create_model", {"session_id": session, "lora_config": {"seed": -1}},
                               "lora_config.seed"),
                              ("/create_model", {"session_id": session, "lora_config": {"rank": 2**40}},
                               "lora_config.rank"),
                              ("/create_sampling_session", {"session_id": session, "sampling_session_seq_id": 2**40},
                               "sampling_session_seq_id"),
                              ("/optim_step", {"model_id": "x", "seq_id": 2**31}, "seq_id"),
                              ("/session_heartbeat", {"session_id": {"a": 1}}, "session_id"),
                              ("/retrieve_future", {"request_id": 5}, "request_id")):
        reply = w.post(path, json=body)
        assert reply.status_code == 400 and field in reply.json()["error"], (path, reply.text)
        assert w.local_port(reply) == port
    reply = w.http.get("/training_runs", params={"offset": 10**30})
    assert reply.status_code == 400 and "offset" in reply.json()["error"], reply.text


def test_malformed_sampling_through_the_sdk_is_a_user_error(cluster, service):
    sampler = service.create_sampling_client(base_model="tiny")
    prompt = types.ModelInput.from_ints([5, 6, 7])
    for params in (types.SamplingParams(max_tokens=-1), types.SamplingParams(max_tokens=2, seed=-1),
                   types.SamplingParams(max_tokens=2, top_k=2**40)):
        with pytest.raises(tinker.BadRequestError) as info:
            sampler.sample(prompt, 1, params).result()
        assert info.value.body["category"] == "user" and "sampling_params" in info.value.body["error"]
    # The client is still good.
    out = sampler.sample(prompt, 1, types.SamplingParams(max_tokens=2, seed=3)).result()
    assert len(out.sequences[0].tokens) == 2


def test_openai_surface_under_oai_api_v1_takes_tinker_sampler_paths(cluster, service):
    training = service.create_lora_training_client(base_model="tiny", rank=4, seed=3).result()
    path = training.save_weights_for_sampler("oai-v1").result().path
    client = openai.OpenAI(base_url=cluster.base_url + "/oai/api/v1", api_key="tml-unused", max_retries=0)
    chat = client.chat.completions.create(model=path, messages=[{"role": "user", "content": "hi"}], max_tokens=3,
                                          seed=1, logprobs=True)
    assert chat.choices[0].message.role == "assistant" and chat.usage.completion_tokens >= 1
    text = client.completions.create(model=path, prompt="hello", max_tokens=3, seed=1)
    assert text.usage.completion_tokens >= 1
    chunks = list(client.chat.completions.create(model=path, messages=[{"role": "user", "content": "hi"}],
                                                 max_tokens=3, seed=1, stream=True))
    assert chunks and chunks[-1].choices[0].finish_reason in ("stop", "length")
    streamed = list(client.completions.create(model=path, prompt="hello", max_tokens=3, seed=1, stream=True))
    assert "".join(c.choices[0].text for c in streamed) == text.choices[0].text
    # The same version as the /v1 name of that checkpoint: one implementation, two mounts.
    adapter = cluster.gateway_settings.default_tenant + "/" + training.model_id.replace(":train:", "-train-")
    v1 = openai.OpenAI(base_url=cluster.base_url + "/v1", api_key="tml-unused", max_retries=0)
    same = v1.completions.create(model=f"{adapter}@v1", prompt="hello", max_tokens=3, seed=1)
    assert same.choices[0].text == text.choices[0].text
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model=path.replace("oai-v1", "never-saved"), prompt="hi", max_tokens=2)
    with pytest.raises(openai.BadRequestError):
        client.completions.create(model=training.save_state("oai-state").result().path, prompt="hi", max_tokens=2)


def _step_logprobs(service, seed) -> np.ndarray:
    training = service.create_lora_training_client(base_model="tiny", rank=4, seed=seed).result()
    seq = [5, 9, 17, 33, 65, 129, 7, 11]
    data = [types.Datum(model_input=types.ModelInput.from_ints(seq[:-1]), loss_fn_inputs={"target_tokens": seq[1:]})]
    training.forward_backward(data, "cross_entropy").result()
    training.optim_step(types.AdamParams(learning_rate=5e-2)).result()
    out = training.forward(data, "cross_entropy").result()
    return training, out.loss_fn_outputs[0]["logprobs"].to_numpy()


def test_unseeded_adapters_are_random_and_recorded_seeded_ones_reproduce(cluster, service):
    """Before the fix the gateway stored `seed or 0`: two unseeded adapters started identical (B is zero, so A's
    initialization shows after one step)."""
    first, a = _step_logprobs(service, None)
    second, b = _step_logprobs(service, None)
    assert np.abs(a - b).max() > 1e-4
    _, c = _step_logprobs(service, 11)
    _, d = _step_logprobs(service, 11)
    np.testing.assert_array_equal(c, d)
    # The drawn seed is recorded with the model (get_info shows it): a resumed run re-creates the same adapter.
    w = Wire(cluster.base_url)
    seeds = [w.ok("/get_info", json={"model_id": t.model_id})["seed"] for t in (first, second)]
    assert all(isinstance(s, int) for s in seeds) and seeds[0] != seeds[1]
    adapter = cluster.gateway_settings.default_tenant + "/" + first.model_id.replace(":train:", "-train-")
    listed = {x.name: x for x in cluster.trainer.stub().ListAdapters(
        trainer_pb2.TrainerServiceListAdaptersRequest(page_size=1000)).adapters}
    assert listed[adapter].lora_config.seed == seeds[0]


def test_adapters_carry_tinkers_lora_alpha(cluster, service):
    """Tinker's adapters carry lora_alpha 32 at every rank (scale 32 / rank); before the fix alpha was the rank."""
    w = Wire(cluster.base_url)
    for rank in (4, 8):
        training = service.create_lora_training_client(base_model="tiny", rank=rank, seed=1).result()
        adapter = cluster.gateway_settings.default_tenant + "/" + training.model_id.replace(":train:", "-train-")
        listed = {x.name: x for x in cluster.trainer.stub().ListAdapters(
            trainer_pb2.TrainerServiceListAdaptersRequest(page_size=1000)).adapters}
        assert listed[adapter].lora_config.alpha == 32.0
        # The exported PEFT adapter_config says so too.
        external = w.future(w.ok("/save_weights_external", json={
            "model_id": training.model_id, "seq_id": 1, "path": f"x-{rank}"})["request_id"])
        name = external["path"].split("/", 3)[3].split("/", 1)[1]
        urls = w.http.get(f"/training_runs/{training.model_id}/checkpoints/external_weights/{name}/"
                          "external_weights_urls").json()["urls"]
        config = httpx.get(urls["adapter_config.json"]).json()
        assert config["lora_alpha"] == 32 and config["r"] == rank


def test_unload_model_releases_the_trainer_adapter(cluster, service):
    w = Wire(cluster.base_url)
    training = service.create_lora_training_client(base_model="tiny", rank=4, seed=2).result()
    state = training.save_state("before-unload").result().path
    adapter = cluster.gateway_settings.default_tenant + "/" + training.model_id.replace(":train:", "-train-")

    def on_trainer() -> bool:
        return adapter in {x.name for x in cluster.trainer.stub().ListAdapters(
            trainer_pb2.TrainerServiceListAdaptersRequest(page_size=1000)).adapters}
    assert on_trainer()
    done = w.future(w.ok("/unload_model", json={"model_id": training.model_id})["request_id"])
    assert done == {"type": "unload_model", "model_id": training.model_id}
    assert not on_trainer()
    reply = w.post("/optim_step", json={"model_id": training.model_id, "seq_id": 2,
                                        "adam_params": {"learning_rate": 1e-3}})
    assert reply.status_code == 400 and "unloaded" in reply.json()["error"]
    # Its checkpoints outlive it.
    resumed = service.create_training_client_from_state(state).result()
    assert resumed.get_info().model_data.model_name == "tiny"
    assert w.post("/unload_model", json={"model_id": "never:train:0"}).status_code == 404


def test_sessions_are_listed_and_described(cluster, service):
    rest = service.create_rest_client()
    training = service.create_lora_training_client(base_model="tiny", rank=4, seed=2).result()
    service.create_sampling_client(base_model="tiny")
    listed = rest.list_sessions(limit=1000).result()
    own = training.model_id.split(":train:")[0]
    assert own in listed.sessions
    described = rest.get_session(own).result()
    assert training.model_id in described.training_run_ids and described.sampler_ids
    assert len(rest.list_sessions(limit=1, offset=0).result().sessions) == 1
    with pytest.raises(tinker.NotFoundError):
        rest.get_session("s000000000000").result()
    # No JWT is issued (docs/tinker.md): the SDK's whoami says so itself, without a request.
    with pytest.raises(RuntimeError, match="JWT"):
        rest.whoami().result()


def test_a_served_name_loads_the_tokenizer_offline(cluster, service, tmp_path):
    """SamplingClient.get_tokenizer() calls AutoTokenizer.from_pretrained(<base model name>): `tiny` is no hub repo,
    so the gateway also serves the base model under its tokenizer directory's path, which loads offline."""
    names = [m.model_name for m in service.get_server_capabilities().supported_models]
    local = [n for n in names if Path(n).is_dir()]
    assert local and local[0].count("/") != 2, names
    sampler = service.create_sampling_client(base_model=local[0])
    out = sampler.sample(types.ModelInput.from_ints([5, 6, 7]), 1, types.SamplingParams(max_tokens=2)).result()
    assert len(out.sequences[0].tokens) == 2
    # The SDK's own lookup, in a process with the hub switched off and an empty cache.
    code = ("import sys\nfrom tinker.lib.public_interfaces.sampling_client import _load_tokenizer_from_model_info\n"
            "t = _load_tokenizer_from_model_info(sys.argv[1])\nprint(t.decode(t.encode('hi there')))")
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "HF_HOME": str(tmp_path)}
    done = subprocess.run([sys.executable, "-c", code, local[0]], check=False, env=env, capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0 and done.stdout.strip() == "hi there", done.stderr[-2000:]
