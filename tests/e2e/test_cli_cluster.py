"""`loraplane up | status | down` as a user runs them: real subprocesses, real servers, health-checked."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest

from loraplane.client.addresses import client_security
from loraplane.local.state import pid_alive, read_cluster_state
from loraplane.rpc import sync_channel
from loraplane.threads import THREADS_ENV, host_cores, thread_shares
from loraplane.v1 import trainer_pb2, trainer_pb2_grpc
from loraplane_cli.local_cluster import component_health
from loraplane_cli.supervisor import CRASH_LOOP_AFTER
from tests.e2e.test_metrics import scrape, value
from tests.e2e.test_trainer_durability import ADAM, create, datum
from tests.fixtures.trainer import Sequenced


def _cli(*args: str, env: dict[str, str] | None = None, timeout: float = 300) -> subprocess.CompletedProcess:
    """The CLI as its own process, as a user runs it: for what starts or stops a cluster (`up`, `down`)."""
    return subprocess.run([sys.executable, "-c", "from loraplane_cli import app; app()", *args],
                          capture_output=True, text=True, timeout=timeout, check=False,
                          env={**os.environ, "COLUMNS": "200", **(env or {})})


def _cli_here(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    """The same CLI in this process (typer's runner), for commands that only read or change a running cluster's
    records and for options refused before anything starts: a fresh process would only add its 3-4 s of imports
    (more under load) to each call. Answers like `_cli`."""
    from rich.console import Console
    from typer.testing import CliRunner

    from loraplane_cli import app

    # The commands print through module-level rich consoles sized when they were made: 200 columns, as `_cli`'s.
    consoles = {id(c): c for name, module in list(sys.modules.items()) if name.startswith("loraplane_cli")
                for c in vars(module).values() if isinstance(c, Console)}.values()
    sizes = [(c._width, c._height) for c in consoles]
    for console in consoles:
        console.size = (200, 25)
    try:
        result = CliRunner().invoke(app, list(args), env=env)
    finally:
        for console, (width, height) in zip(consoles, sizes, strict=True):
            console._width, console._height = width, height
    if result.exception is not None and not isinstance(result.exception, SystemExit):
        raise result.exception
    return subprocess.CompletedProcess(list(args), result.exit_code, result.stdout, result.stderr)


@pytest.mark.timeout(600)  # a whole cluster's life, 2-3 min; more when the machine is loaded
def test_up_starts_every_service_the_supervisor_restarts_what_dies_and_down_stops_them(tmp_path):
    """One embedded cluster (its own Valkey and SeaweedFS) through its life: `up`, `status`, a second `up`, the
    supervisor's restarts and crash-loop report, `up` over a partly dead cluster, `down`."""
    data_dir = tmp_path / "cluster"
    up = _cli("up", "--data-dir", str(data_dir))
    assert up.returncode == 0, up.stdout + up.stderr
    try:
        state = read_cluster_state(data_dir)
        assert [c.name for c in state.components] == ["redis", "s3", "registry", "trainer", "sampler", "gateway"]
        assert f"TINKER_BASE_URL={state.component('gateway').endpoint}" in up.stdout
        assert [c.kind for c in state.components[:2]] == ["valkey", "seaweedfs"]
        for component in state.components:
            assert component.endpoint in up.stdout
        status = _cli_here("status", "--data-dir", str(data_dir))
        assert status.returncode == 0, status.stdout + status.stderr
        assert status.stdout.count("healthy") == 6, status.stdout
        assert "tiny on torch/cpu; adapters: none" in status.stdout
        assert "torch engine; queue depth 0" in status.stdout
        assert "supervisor: running" in status.stdout and pid_alive(state.supervisor_pid)
        # The trainer and the sampler share this host's cores (issue 31), each process's torch sized to its share.
        assert _torch_threads(state, "trainer", "sampler") == thread_shares(host_cores(), 2)
        # Only its owner may read the state file: it records the services' environment, service key included.
        assert (data_dir / "cluster.json").stat().st_mode & 0o077 == 0
        # A second `up` on the same data dir starts nothing: no second cluster over the same files.
        again = _cli("up", "--data-dir", str(data_dir))
        assert again.returncode == 0 and "already running" in again.stdout, again.stdout + again.stderr
        assert [c.pid for c in read_cluster_state(data_dir).components] == [c.pid for c in state.components]

        after = _supervisor_restarts_what_dies_and_up_starts_only_what_is_missing(data_dir)
    finally:
        down = _cli("down", "--data-dir", str(data_dir))
    assert down.returncode == 0, down.stdout + down.stderr
    assert "stopped: gateway, sampler, trainer, registry, s3, redis" in down.stdout
    assert not any(pid_alive(c.pid) for c in after.components) and not pid_alive(after.supervisor_pid)
    assert read_cluster_state(data_dir) is None
    gone = _cli_here("status", "--data-dir", str(data_dir))
    assert gone.returncode == 1 and "no cluster is running" in gone.stdout


def test_up_uses_external_redis_and_s3_when_configured(tmp_path, valkey, seaweed):
    data_dir = tmp_path / "cluster"
    env = {"LORAPLANE_REDIS_URL": valkey.url, "LORAPLANE_S3_ENDPOINT": seaweed.endpoint,
           "LORAPLANE_S3_ACCESS_KEY": seaweed.access_key, "LORAPLANE_S3_SECRET_KEY": seaweed.secret_key,
           "LORAPLANE_S3_BUCKET": "lp-cli-external", "LORAPLANE_KEY_PREFIX": "lpcli:"}
    up = _cli("up", "--data-dir", str(data_dir), "--services", "registry", env=env)
    assert up.returncode == 0, up.stdout + up.stderr
    try:
        state = read_cluster_state(data_dir)
        assert [(c.name, c.kind) for c in state.components] == [
            ("redis", "external"), ("s3", "external"), ("registry", "service")]
        assert not (data_dir / "valkey").exists() and not (data_dir / "seaweedfs").exists()
        status = _cli_here("status", "--data-dir", str(data_dir))
        assert status.stdout.count("external") >= 2 and "healthy" in status.stdout
    finally:
        _cli("down", "--data-dir", str(data_dir))


def _torch_threads(state, *names: str) -> list[int]:
    """Each named service's intra-op torch threads, as its own metrics endpoint reports them."""
    return [int(value(scrape(state.component(name).metrics), "loraplane_torch_threads")) for name in names]


def test_up_hands_each_published_version_to_its_sampler_in_memory(tmp_path, valkey, seaweed):
    """`loraplane up`'s sampler is a sampler fleet of one that its trainer names, so a published version reaches the
    sampler straight from the trainer (shared memory on one host), not through a registry download. A torch thread
    count the user sets reaches every service in place of the cluster's shares."""
    from loraplane.client import AdamParams, ServiceClient, datum_from_sequence
    from loraplane.client.types import SamplingParams

    data_dir = tmp_path / "cluster"
    env = {"LORAPLANE_REDIS_URL": valkey.url, "LORAPLANE_S3_ENDPOINT": seaweed.endpoint,
           "LORAPLANE_S3_ACCESS_KEY": seaweed.access_key, "LORAPLANE_S3_SECRET_KEY": seaweed.secret_key,
           "LORAPLANE_S3_BUCKET": "lp-cli-handoff", "LORAPLANE_KEY_PREFIX": "lpclihandoff:", THREADS_ENV: "3"}
    up = _cli("up", "--data-dir", str(data_dir), "--no-gateway", env=env)
    assert up.returncode == 0, up.stdout + up.stderr
    try:
        state = read_cluster_state(data_dir)
        assert _torch_threads(state, "trainer", "sampler") == [3, 3]
        assert state.component("trainer").env.get("LORAPLANE_SAMPLER_FLEET") == "sampler"
        service = ServiceClient(data_dir=data_dir)
        training = service.create_lora_training_client("tiny", rank=4, seed=3, name="team/handoff")
        training.forward_backward([datum_from_sequence(list(range(10, 30)))], "cross_entropy").result(timeout=120)
        training.optim_step(AdamParams(learning_rate=1e-2)).result(timeout=60)
        sampling = training.save_weights_and_get_sampling_client()
        out = sampling.sample([5, 6, 7], 1, SamplingParams(max_tokens=3, seed=1)).result(timeout=60)
        assert len(out.sequences[0].tokens) == 3
        loads = scrape(state.component("sampler").metrics)
        assert value(loads, "loraplane_sampler_version_loads_total", path="push") >= 1, loads
        assert value(loads, "loraplane_sampler_version_loads_total", path="registry") == 0, loads
    finally:
        down = _cli("down", "--data-dir", str(data_dir), env=env)
    assert down.returncode == 0, down.stdout + down.stderr


def test_up_rejects_an_unknown_service(tmp_path):
    result = _cli_here("up", "--data-dir", str(tmp_path / "c"), "--services", "registry,bogus")
    assert result.returncode != 0
    assert "bogus" in result.stdout + result.stderr and "--services" in result.stdout + result.stderr
    assert read_cluster_state(tmp_path / "c") is None


def test_up_rejects_an_unknown_sampler_engine_and_the_sampler_reads_its_engine_from_the_environment(tmp_path,
                                                                                                     monkeypatch):
    result = _cli_here("up", "--data-dir", str(tmp_path / "c"), "--sampler-engine", "vllm")
    assert result.returncode != 0
    assert "vllm" in result.stdout + result.stderr and "--sampler-engine" in result.stdout + result.stderr
    assert read_cluster_state(tmp_path / "c") is None
    # What `up --sampler-engine sglang` hands the sampler process: SGLang, one launched server, the extra arguments.
    from sampler_svc.__main__ import parse_args

    assert parse_args([]).engine == "torch"
    monkeypatch.setenv("LORAPLANE_SAMPLER_ENGINE", "sglang")
    monkeypatch.setenv("LORAPLANE_SAMPLER_SGLANG_ARGS", "--mem-fraction-static=0.3")
    args = parse_args(["--sglang-arg=--dtype=bfloat16"])
    assert (args.engine, args.sglang_launch) == ("sglang", 1)
    assert args.sglang_arg == ["--mem-fraction-static=0.3", "--dtype=bfloat16"]
    assert parse_args(["--sglang-url", "http://h:1"]).sglang_launch == 0


def _wait_for(predicate, timeout: float, what: str):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        found = predicate()
        if found:
            return found
        time.sleep(0.2)
    raise AssertionError(f"timed out waiting for {what}")


def _trainer_adapters(address: str, data_dir) -> dict[str, trainer_pb2.AdapterInfo]:
    with sync_channel(address, client_security(data_dir)) as channel:
        listed = trainer_pb2_grpc.TrainerServiceStub(channel).ListAdapters(
            trainer_pb2.TrainerServiceListAdaptersRequest(), timeout=10)
    return {a.name: a for a in listed.adapters}


def _supervisor_restarts_what_dies_and_up_starts_only_what_is_missing(data_dir):
    """The running cluster's supervisor restarts a SIGKILLed trainer where it was, reports a crash loop, and `up`
    on a partly dead cluster starts only what is missing. Returns the cluster's state at the end."""
    first = read_cluster_state(data_dir)
    trainer = first.component("trainer")
    with sync_channel(trainer.endpoint, client_security(data_dir)) as channel:  # with the admin key
        stub = trainer_pb2_grpc.TrainerServiceStub(channel)
        create(stub, "kept")
        Sequenced(stub, "kept", ADAM).train([datum(1)])

    # A crash of the trainer: the supervisor restarts it where it was and it recovers its adapter from the journal.
    os.killpg(trainer.pid, signal.SIGKILL)
    restarted = _wait_for(lambda: (c := read_cluster_state(data_dir).component("trainer")).pid != trainer.pid
                          and component_health(c, str(data_dir)) == "healthy" and c, 180, "the trainer's restart")
    assert restarted.restarts == 1 and restarted.endpoint == trainer.endpoint
    assert "SIGKILL" in restarted.last_exit or "unknown" in restarted.last_exit
    kept = _trainer_adapters(restarted.endpoint, data_dir)["kept"]
    assert (kept.step, kept.last_seq_id) == (1, 2)

    # A crash loop: the registry dies again each time soon after it is restarted.
    for death in range(CRASH_LOOP_AFTER):
        current = read_cluster_state(data_dir).component("registry")
        os.killpg(current.pid, signal.SIGKILL)
        if death < CRASH_LOOP_AFTER - 1:
            _wait_for(lambda dead=current.pid: (c := read_cluster_state(data_dir).component("registry")).pid != dead
                      and pid_alive(c.pid), 60, "the registry's restart")
    looping = _wait_for(lambda: (c := read_cluster_state(data_dir).component("registry")).supervision
                        == "crash-loop" and c, 60, "the crash loop to be reported")
    assert looping.restarts >= CRASH_LOOP_AFTER - 1 and "SIGKILL" in looping.last_exit
    # Shown until the registry has run STABLE_AFTER_S after its next restart (in-process: a CLI process's imports
    # could outlast that on a loaded machine).
    status = _cli_here("status", "--data-dir", str(data_dir))
    assert "crash-loop" in status.stdout, status.stdout
    # Left alone, the next restart sticks.
    _wait_for(lambda: component_health(read_cluster_state(data_dir).component("registry"),
                                       str(data_dir)) == "healthy", 90, "the registry to come back")

    # `up` on a partly dead cluster (supervisor and sampler gone) starts only those two.
    before = read_cluster_state(data_dir)
    os.killpg(before.supervisor_pid, signal.SIGKILL)
    os.killpg(before.component("sampler").pid, signal.SIGKILL)
    _wait_for(lambda: not pid_alive(before.supervisor_pid) and not pid_alive(before.component("sampler").pid),
              10, "the kills")
    status = _cli_here("status", "--data-dir", str(data_dir))
    assert "supervisor: down" in status.stdout and "down" in status.stdout
    again = _cli("up", "--data-dir", str(data_dir))
    assert again.returncode == 0 and "started: sampler)" in again.stdout, again.stdout + again.stderr
    after = read_cluster_state(data_dir)
    for name in ("redis", "s3", "registry", "trainer"):
        assert after.component(name).pid == before.component(name).pid, name
    assert pid_alive(after.supervisor_pid) and after.supervisor_pid != before.supervisor_pid
    assert all(component_health(c, str(data_dir)) == "healthy" for c in after.components)
    return after
