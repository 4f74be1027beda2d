"""docker-compose.yml and the Dockerfile: structure checked with pyyaml, commands checked against the real
entry points, and `docker compose config` when the docker CLI has the compose plugin."""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
COMPOSE = ROOT / "docker-compose.yml"
DOCKERFILE = ROOT / "Dockerfile"
GRPC_SERVICES = {"registry_svc": "loraplane.v1.AdapterRegistryService", "trainer_svc": "loraplane.v1.TrainerService",
                 "trainer_svc.torchrun": "loraplane.v1.TrainerService",
                 "sampler_svc": "loraplane.v1.SamplerService"}


@pytest.fixture(scope="module")
def compose() -> dict:
    return yaml.safe_load(COMPOSE.read_text())


def _module_of(service: dict) -> str | None:
    command = service.get("command") or []
    if "-m" in command:
        return command[command.index("-m") + 1]
    return None


def _port_of(command: list[str]) -> str:
    return command[command.index("--port") + 1]


def test_storage_is_the_official_images_pinned_with_aof_on(compose):
    services = compose["services"]
    redis, minio = services["redis"], services["minio"]
    assert re.fullmatch(r"redis:\d+\.\d+\.\d+(-\w+)?", redis["image"])
    assert re.fullmatch(r"minio/minio:RELEASE\.\d{4}-\d\d-\d\dT[\d-]+Z", minio["image"])
    assert redis["command"][redis["command"].index("--appendonly") + 1] == "yes"
    assert "redis-data:/data" in redis["volumes"] and "minio-data:/data" in minio["volumes"]


def test_every_image_is_pinned_and_every_service_has_a_health_check(compose):
    for name, service in compose["services"].items():
        image = service.get("image", "")
        assert image and ":" in image and not image.endswith(":latest"), f"{name} image {image!r} is not pinned"
        assert service.get("healthcheck", {}).get("test"), f"{name} has no health check"


def test_grpc_services_probe_grpc_health_on_the_port_they_serve(compose):
    seen = set()
    for name, service in compose["services"].items():
        module = _module_of(service)
        if module not in GRPC_SERVICES:
            continue
        seen.add(module)
        probe = " ".join(service["healthcheck"]["test"])
        port = _port_of(service["command"])
        assert f"127.0.0.1:{port}" in probe and GRPC_SERVICES[module] in probe, name
        assert "check_health" in probe
        env = service["environment"]
        assert env["LORAPLANE_REDIS_URL"].startswith("redis://redis:")
        assert env["LORAPLANE_S3_ENDPOINT"] == "minio:9000"
        assert env["LORAPLANE_REGISTRY_ADDRESS"] == "registry:50051"
    assert seen == set(GRPC_SERVICES)


def test_dependencies_exist_and_wait_for_health(compose):
    services = compose["services"]
    for name, service in services.items():
        for dependency, condition in (service.get("depends_on") or {}).items():
            assert dependency in services, f"{name} depends on unknown {dependency}"
            assert condition["condition"] == "service_healthy"
            # A default-profile service must not wait on a profile-only one.
            if not service.get("profiles"):
                assert not services[dependency].get("profiles"), f"{name} waits on profiled {dependency}"


def test_named_volumes_are_declared(compose):
    declared = set(compose["volumes"])
    for name, service in compose["services"].items():
        for volume in service.get("volumes", []):
            source = volume.split(":")[0]
            if not source.startswith(("/", ".")):
                assert source in declared, f"{name} uses undeclared volume {source}"


def test_gpu_profile_runs_megatron_and_sglang(compose):
    services = compose["services"]
    gpu = {n for n, s in services.items() if "gpu" in s.get("profiles", [])}
    assert gpu == {"trainer-gpu", "sampler-gpu", "sglang"}
    trainer, sampler = services["trainer-gpu"]["command"], services["sampler-gpu"]["command"]
    assert trainer[0] == "torchrun" and _module_of(services["trainer-gpu"]) == "trainer_svc.torchrun"
    assert sampler[sampler.index("--engine") + 1] == "sglang"
    assert sampler[sampler.index("--sglang-url") + 1] == "http://sglang:30000"
    assert "--enable-lora" in services["sglang"]["command"]
    # Logprobs of the unscaled distribution, as the sampler serves them (sampler_svc/engines/sglang_servers.py).
    assert services["sglang"]["environment"]["SGLANG_RETURN_ORIGINAL_LOGPROB"] == "True"
    for name in ("trainer-gpu", "sglang"):
        devices = services[name]["deploy"]["resources"]["reservations"]["devices"]
        assert devices[0]["driver"] == "nvidia" and devices[0]["capabilities"] == ["gpu"], name
    # The default (CPU) services stay on torch.
    assert services["trainer"]["command"][services["trainer"]["command"].index("--backend") + 1] == "torch"
    assert services["sampler"]["command"][services["sampler"]["command"].index("--engine") + 1] == "torch"


def test_build_targets_exist_in_the_dockerfile(compose):
    stages = set(re.findall(r"^FROM\s+\S+\s+AS\s+(\w+)", DOCKERFILE.read_text(), flags=re.MULTILINE))
    assert stages == {"cpu", "gpu"}
    for name, service in compose["services"].items():
        if "build" in service:
            assert service["build"]["target"] in stages, name
    text = DOCKERFILE.read_text()
    for package in ("loraplane", "registry_svc", "trainer_svc", "sampler_svc"):
        assert f"COPY {package} ./{package}" in text


def _help_of(module: str) -> str:
    result = subprocess.run([sys.executable, "-m", module, "--help"], cwd=ROOT, capture_output=True, text=True,
                            timeout=120, check=False)
    assert result.returncode == 0, result.stderr[-2000:]
    return result.stdout


@pytest.mark.parametrize("module", sorted(GRPC_SERVICES))
def test_compose_commands_use_flags_the_entry_points_accept(compose, module):
    entry = ROOT / module.replace(".", "/")
    if not ((entry / "__main__.py").exists() or entry.with_suffix(".py").exists()):
        pytest.skip(f"{module} does not exist yet")
    help_text = _help_of(module)
    for name, service in compose["services"].items():
        if _module_of(service) != module:
            continue
        for flag in (arg for arg in service["command"] if arg.startswith("--")):
            if service["command"][0] == "torchrun" and service["command"].index(flag) < service["command"].index("-m"):
                continue  # torchrun's own flags
            assert flag in help_text, f"{name}: `python -m {module}` has no {flag} flag"


def _compose_cli() -> list[str] | None:
    docker = shutil.which("docker")
    if docker and subprocess.run([docker, "compose", "version"], capture_output=True, check=False).returncode == 0:
        return [docker, "compose"]
    legacy = shutil.which("docker-compose")
    return [legacy] if legacy else None


@pytest.mark.parametrize("profile", [None, "gpu"])
def test_docker_compose_config_accepts_the_file(profile):
    cli = _compose_cli()
    if cli is None:
        pytest.skip("the docker CLI here has no compose plugin (`docker compose` is an unknown command) and no "
                    "docker-compose binary; the YAML structure is checked by the other tests")
    args = [*cli, "-f", str(COMPOSE), *(["--profile", profile] if profile else []), "config", "--quiet"]
    result = subprocess.run(args, cwd=ROOT, capture_output=True, text=True, timeout=60, check=False)
    assert result.returncode == 0, result.stderr
