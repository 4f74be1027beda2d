"""deploy/kubernetes: every overlay rendered, each object validated offline against the Kubernetes API schemas
(kubernetes-validate), and each container checked against the services it runs: the module exists and accepts
its arguments (parsed by the service's own parser), ports agree between the process, the container, the Service
and the probes, every LORAPLANE_* variable is a setting, each trainer's torchrun job finds its own pods and rank 0
is the pod that serves gRPC, and the trainers and samplers are fleets: each pod a member under its stable pod name,
advertising its pod's DNS name and served port, with the gateway reading the same trainer fleet in the same Redis.

No cluster is reachable here, so nothing is applied. Rendering uses a small kustomize of the subset these
manifests use (resources, components, patches as strategic merges, images, namespace, labels), which refuses any
other feature; where a kustomize binary is installed (`kubectl kustomize` or `kustomize`), its output must equal
ours object for object."""

from __future__ import annotations

import asyncio
import copy
import importlib
import importlib.util
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import kubernetes_validate  # the dev extra; CI must not skip this file for want of it
import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
K8S = ROOT / "deploy" / "kubernetes"
OVERLAYS = ("cpu", "gpu")
# The oldest Kubernetes the manifests are for (native sidecars: restartPolicy on an init container, 1.29) and the
# newest whose schemas kubernetes-validate ships.
K8S_VERSIONS = ("1.29", kubernetes_validate.latest_version())
LORAPLANE_IMAGE = "loraplane"

# ------------------------------------------------------------------ a small kustomize

KUSTOMIZATION_FIELDS = {"apiVersion", "kind", "resources", "components", "patches", "images", "namespace", "labels"}
# patchMergeKey of the lists these manifests patch (core/v1 PodSpec, Container, ServiceSpec); other lists replace.
MERGE_KEYS = {"containers": "name", "initContainers": "name", "env": "name", "volumeMounts": "mountPath",
              "volumes": "name", "imagePullSecrets": "name"}
PORT_KEYS = ("containerPort", "port")


def _merge_key(field: str, items: list) -> str | None:
    if field == "ports":
        for key in PORT_KEYS:
            if items and all(isinstance(i, dict) and key in i for i in items):
                return key
        return None
    return MERGE_KEYS.get(field)


def strategic_merge(base, patch, field: str = ""):
    """Strategic merge patch for the shapes used here: maps merge (null deletes a key), lists with a patch merge
    key merge element by element (patched elements first, in the patch's order, then the base's others, as
    kustomize orders them), other lists and scalars are replaced."""
    if isinstance(patch, dict) and isinstance(base, dict):
        if any(k.startswith("$") for k in patch):
            raise ValueError(f"strategic-merge directive {sorted(patch)} not supported by this renderer")
        out = dict(base)
        for key, value in patch.items():
            if value is None:
                out.pop(key, None)
            elif key in out:
                out[key] = strategic_merge(out[key], value, key)
            else:
                out[key] = copy.deepcopy(value)
        return out
    if isinstance(patch, list) and isinstance(base, list):
        key = _merge_key(field, patch + base)
        if key is None:
            return copy.deepcopy(patch)
        by_key = {item[key]: item for item in base}
        merged = [strategic_merge(by_key[item[key]], item, field) if item[key] in by_key else copy.deepcopy(item)
                  for item in patch]
        patched = {item[key] for item in patch}
        return merged + [copy.deepcopy(item) for item in base if item[key] not in patched]
    return copy.deepcopy(patch)


def _load_yaml_docs(path: Path) -> list[dict]:
    return [doc for doc in yaml.safe_load_all(path.read_text()) if doc]


def _ident(obj: dict) -> tuple[str, str]:
    return obj["kind"], obj["metadata"]["name"]


def _pod_specs(obj: dict) -> list[dict]:
    template = obj.get("spec", {}).get("template")
    return [template["spec"]] if template else []


def kustomize(directory: Path, expect_kind: str = "Kustomization") -> list[dict]:
    spec = yaml.safe_load((directory / "kustomization.yaml").read_text())
    unknown = set(spec) - KUSTOMIZATION_FIELDS
    assert not unknown, f"{directory}: kustomization fields {unknown} are not implemented by this test's renderer"
    assert spec.get("kind", "Kustomization") == expect_kind, f"{directory} is not a {expect_kind}"
    objects: list[dict] = []
    for entry in spec.get("resources", []):
        path = (directory / entry).resolve()
        objects += kustomize(path) if path.is_dir() else _load_yaml_docs(path)
    seen = [_ident(o) for o in objects]
    assert len(seen) == len(set(seen)), f"{directory}: duplicate objects {seen}"
    for entry in spec.get("components", []):
        component = (directory / entry).resolve()
        objects = _apply_component(component, objects)
    for entry in spec.get("patches", []):
        assert set(entry) == {"path"}, f"{directory}: only `patches: - path:` is implemented, got {entry}"
        for patch in _load_yaml_docs(directory / entry["path"]):
            objects = _apply_patch(objects, patch, directory / entry["path"])
    for image in spec.get("images", []):
        assert set(image) <= {"name", "newName", "newTag"}, image
        for obj in objects:
            for pod in _pod_specs(obj):
                for container in pod.get("containers", []) + pod.get("initContainers", []):
                    name, _, tag = container["image"].partition(":")
                    if name == image["name"]:
                        container["image"] = f"{image.get('newName', name)}:{image.get('newTag', tag)}"
    if "namespace" in spec:
        for obj in objects:
            obj["metadata"]["namespace"] = spec["namespace"]
    for entry in spec.get("labels", []):
        assert set(entry) == {"pairs"}, f"{directory}: only plain `labels: - pairs:` is implemented, got {entry}"
        for obj in objects:
            obj["metadata"].setdefault("labels", {}).update(entry["pairs"])
    return objects


def _apply_component(directory: Path, objects: list[dict]) -> list[dict]:
    spec = yaml.safe_load((directory / "kustomization.yaml").read_text())
    assert spec.get("kind") == "Component", f"{directory} is not a Component"
    assert set(spec) <= {"apiVersion", "kind", "patches"}, f"{directory}: component fields {set(spec)}"
    for entry in spec.get("patches", []):
        assert set(entry) == {"path"}, entry
        for patch in _load_yaml_docs(directory / entry["path"]):
            objects = _apply_patch(objects, patch, directory / entry["path"])
    return objects


def _apply_patch(objects: list[dict], patch: dict, source: Path) -> list[dict]:
    matches = [i for i, o in enumerate(objects) if _ident(o) == _ident(patch)]
    assert len(matches) == 1, f"{source}: patch {_ident(patch)} matches {len(matches)} objects"
    index = matches[0]
    objects = list(objects)
    objects[index] = strategic_merge(objects[index], patch)
    return objects


def _kustomize_binary() -> list[str] | None:
    if shutil.which("kustomize"):
        return ["kustomize", "build"]
    if shutil.which("kubectl"):
        return ["kubectl", "kustomize"]
    return None


# ------------------------------------------------------------------ fixtures

def _tls_overlay(tmp: Path, overlay: str) -> Path:
    """The overlay with the tls component added, as an operator's own overlay would add it (kustomize wants
    relative paths)."""
    directory = tmp / f"{overlay}-tls"
    directory.mkdir()
    (directory / "kustomization.yaml").write_text(yaml.safe_dump({
        "apiVersion": "kustomize.config.k8s.io/v1beta1", "kind": "Kustomization",
        "resources": [os.path.relpath(K8S / "overlays" / overlay, directory)],
        "components": [os.path.relpath(K8S / "tls", directory)]}))
    return directory


VARIANTS = [*OVERLAYS, *(f"{o}-tls" for o in OVERLAYS)]


@pytest.fixture(scope="module")
def variant_dirs(tmp_path_factory) -> dict[str, Path]:
    tmp = tmp_path_factory.mktemp("overlays")
    dirs = {o: K8S / "overlays" / o for o in OVERLAYS}
    dirs.update({f"{o}-tls": _tls_overlay(tmp, o) for o in OVERLAYS})
    return dirs


@pytest.fixture(scope="module")
def rendered(variant_dirs) -> dict[str, dict[tuple[str, str], dict]]:
    out = {}
    for name, directory in variant_dirs.items():
        objects = kustomize(directory)
        out[name] = {_ident(o): o for o in objects}
    return out


def _containers(obj: dict, init: bool = True) -> list[dict]:
    out = []
    for pod in _pod_specs(obj):
        out += pod.get("containers", []) + (pod.get("initContainers", []) if init else [])
    return out


def _workloads(objects: dict) -> list[dict]:
    return [o for (kind, _), o in objects.items() if kind in ("Deployment", "StatefulSet")]


def _loraplane_containers(objects: dict):
    for obj in _workloads(objects):
        for container in _containers(obj):
            if container["image"].rpartition("/")[2].startswith(LORAPLANE_IMAGE + ":"):
                yield obj, container


def _env(objects: dict, container: dict) -> dict[str, str | None]:
    """The container's environment: ConfigMap values and literal values; Secret-backed and fieldRef ones as None."""
    env: dict[str, str | None] = {}
    for source in container.get("envFrom", []):
        env.update(objects[("ConfigMap", source["configMapRef"]["name"])]["data"])
    for var in container.get("env", []):
        env[var["name"]] = var.get("value")
    return env


def _module_and_args(command: list[str]) -> tuple[str, list[str]]:
    index = command.index("-m")
    return command[index + 1], command[index + 2:]


# ------------------------------------------------------------------ tests

@pytest.mark.parametrize("variant", VARIANTS)
def test_our_renderer_matches_kustomize_where_installed(variant, variant_dirs, rendered):
    binary = _kustomize_binary()
    if binary is None:
        pytest.skip("no kustomize or kubectl here; the renderer's output is still validated below")
    result = subprocess.run([*binary, str(variant_dirs[variant])], capture_output=True, text=True, timeout=60,
                            check=False)
    assert result.returncode == 0, result.stderr
    theirs = {_ident(o): o for o in yaml.safe_load_all(result.stdout) if o}
    assert sorted(theirs) == sorted(rendered[variant])
    for ident, obj in theirs.items():
        assert obj == rendered[variant][ident], f"{variant}: {ident} differs from kustomize's rendering"


def test_renderer_merges_as_a_strategic_merge_patch_does():
    base = {"spec": {"containers": [{"name": "a", "image": "x:1", "env": [{"name": "A", "value": "1"}],
                                     "ports": [{"containerPort": 1, "name": "p"}], "command": ["a", "b"]}],
                     "volumes": [{"name": "v", "emptyDir": {}}], "tolerations": [{"key": "k"}]}}
    patch = {"spec": {"containers": [{"name": "a", "env": [{"name": "B", "value": "2"}],
                                      "ports": [{"containerPort": 2, "name": "q"}], "command": ["c"]}],
                      "volumes": [{"name": "v", "emptyDir": None, "persistentVolumeClaim": {"claimName": "c"}}],
                      "tolerations": [{"key": "t"}]}}
    merged = strategic_merge(base, patch)
    container = merged["spec"]["containers"][0]
    assert container["image"] == "x:1" and container["command"] == ["c"]
    assert [e["name"] for e in container["env"]] == ["B", "A"]
    assert [p["containerPort"] for p in container["ports"]] == [2, 1]
    assert merged["spec"]["volumes"] == [{"name": "v", "persistentVolumeClaim": {"claimName": "c"}}]
    assert merged["spec"]["tolerations"] == [{"key": "t"}]
    with pytest.raises(ValueError):
        strategic_merge(base, {"spec": {"$patch": "replace"}})


@pytest.mark.parametrize("variant", VARIANTS)
def test_every_object_validates_against_the_kubernetes_schemas(variant, rendered):
    for ident, obj in rendered[variant].items():
        for version in K8S_VERSIONS:
            try:
                kubernetes_validate.validate(obj, version, strict=True)
            except kubernetes_validate.ValidationError as exc:
                pytest.fail(f"{variant}: {ident} is invalid for Kubernetes {version}: {exc.message} at "
                            f"{'.'.join(map(str, exc.path))}")


GRPC_SERVICE_OF = {"registry_svc": "loraplane.v1.AdapterRegistryService",
                   "trainer_svc": "loraplane.v1.TrainerService",
                   "trainer_svc.torchrun": "loraplane.v1.TrainerService",
                   "sampler_svc": "loraplane.v1.SamplerService"}


def _parse_service_args(module: str, args: list[str], monkeypatch):
    """The service's own argument parser on the container's arguments (argparse exits on an unknown flag)."""
    if module == "registry_svc":
        server = importlib.import_module("registry_svc.server")
        seen = {}

        def capture(coro):
            seen["frame"] = coro.cr_frame.f_locals
            coro.close()

        monkeypatch.setattr(sys, "argv", ["registry_svc", *args])
        monkeypatch.setattr(server.asyncio, "run", capture)
        server.main()
        return type("Args", (), {"port": seen["frame"]["port"], "host": seen["frame"]["host"]})
    if module == "trainer_svc.torchrun":
        return importlib.import_module(module).parse_args(args)
    return importlib.import_module(f"{module}.__main__").parse_args(args)


def _named_port(container: dict, name_or_number) -> int:
    if isinstance(name_or_number, int):
        return name_or_number
    ports = {p.get("name"): p["containerPort"] for p in container.get("ports", [])}
    assert name_or_number in ports, f"{container['name']}: no port named {name_or_number}"
    return ports[name_or_number]


def _services_selecting(objects: dict, labels: dict) -> list[dict]:
    return [o for (kind, _), o in objects.items() if kind == "Service" and o["spec"].get("selector")
            and all(labels.get(k) == v for k, v in o["spec"]["selector"].items())]


def _probe_ports(container: dict) -> list[tuple[str, dict]]:
    return [(kind, container[kind]) for kind in ("startupProbe", "readinessProbe", "livenessProbe") if kind in container]


@pytest.mark.parametrize("variant", VARIANTS)
def test_commands_and_ports_match_the_services(variant, rendered, monkeypatch):
    objects = rendered[variant]
    served = set()
    for obj, container in _loraplane_containers(objects):
        command = container["command"]
        assert "args" not in container, "the whole command line lives in `command`"
        module, args = _module_and_args(command)
        assert importlib.util.find_spec(module) is not None, f"{module} does not exist"
        if command[0] == "torchrun":
            continue  # test_torchrun_job_spans_the_trainer_pods
        assert command[:2] == ["python", "-m"], command
        env = _env(objects, container)
        if module == "gateway_svc":
            from gateway_svc.app import OPEN_PATHS
            from gateway_svc.config import GatewaySettings

            assert args == [], "the gateway takes its settings from LORAPLANE_GATEWAY_* only"
            for key, value in env.items():
                if value is not None:
                    monkeypatch.setenv(key, value)
            settings = GatewaySettings()
            assert settings.host == "0.0.0.0"
            port = settings.port
            for kind, probe in _probe_ports(container):
                assert probe["httpGet"]["path"] in OPEN_PATHS, f"{kind} of the gateway needs a key"
                assert _named_port(container, probe["httpGet"]["port"]) == port
            assert {"startupProbe", "readinessProbe", "livenessProbe"} <= set(container)
        else:
            parsed = _parse_service_args(module, args, monkeypatch)
            port = parsed.port
            assert parsed.host == "0.0.0.0"
            _check_grpc_probes(variant, module, container, port)
        served.add(module)
        assert _named_port(container, "grpc" if module != "gateway_svc" else "http") == port
        labels = obj["spec"]["template"]["metadata"]["labels"]
        services = _services_selecting(objects, labels)
        clusterip = [s for s in services if s["spec"].get("clusterIP") != "None"]
        assert len(clusterip) == 1, f"{_ident(obj)} is behind {len(clusterip)} Services"
        target = clusterip[0]["spec"]["ports"][0]["targetPort"]
        assert _named_port(container, target) == port
    expected = {"registry_svc", "sampler_svc", "gateway_svc"} | ({"trainer_svc"} if variant.startswith("cpu") else set())
    assert served == expected


def _check_grpc_probes(variant: str, module: str, container: dict, port: int) -> None:
    probes = _probe_ports(container)
    assert {kind for kind, _ in probes} == {"startupProbe", "readinessProbe", "livenessProbe"}, container["name"]
    for kind, probe in probes:
        if variant.endswith("-tls"):
            # Kubernetes' own gRPC probe speaks plaintext only: with TLS the probe is our health check over TLS.
            script = probe["exec"]["command"][-1]
            assert f"'127.0.0.1:{port}'" in script and f"'{GRPC_SERVICE_OF[module]}'" in script, script
            assert "grpc" not in probe
        else:
            assert probe["grpc"] == {"port": port, "service": GRPC_SERVICE_OF[module]}, f"{kind}: {probe}"


async def test_tls_probe_passes_on_a_tls_server_and_fails_when_it_does_not_serve(rendered, tmp_path):
    """The tls component's exec probe is real Python: run it against a gRPC server with TLS whose certificate names
    only the Service (not 127.0.0.1), as the Secret's would -> exit 0; the same server not serving -> exit 1."""
    from loraplane.local.tls import make_local_pki
    from loraplane.rpc import GrpcServer, ServerSecurity

    registry = rendered["cpu-tls"][("Deployment", "loraplane-registry")]
    (container,) = _containers(registry)
    env = {k: v for k, v in _env(rendered["cpu-tls"], container).items() if v is not None}
    mount = next(m["mountPath"] for m in container["volumeMounts"] if m["name"] == "tls")
    for key in ("LORAPLANE_TLS_CERT", "LORAPLANE_TLS_KEY", "LORAPLANE_TLS_CA"):
        assert Path(env[key]).parent == Path(mount)
    pki = make_local_pki(tmp_path / "pki", ("loraplane-registry",))
    security = ServerSecurity(pki.server_cert.read_bytes(), pki.server_key.read_bytes(), None)
    server = GrpcServer("127.0.0.1", 0, security=security)
    server.add_service(GRPC_SERVICE_OF["registry_svc"])
    await server.start()
    script = container["readinessProbe"]["exec"]["command"]
    assert script[:2] == ["python", "-c"]
    code = script[2].replace("127.0.0.1:50051", f"127.0.0.1:{server.port}")
    probe_env = {"PATH": "/usr/bin:/bin", "PYTHONPATH": str(ROOT), "LORAPLANE_TLS_CA": str(pki.ca)}

    async def run_probe() -> int:
        process = await asyncio.create_subprocess_exec(sys.executable, "-c", code, env=probe_env, cwd=ROOT)
        return await asyncio.wait_for(process.wait(), 60)

    try:
        assert await run_probe() == 0
        await server.set_serving(False)
        assert await run_probe() == 1
    finally:
        await server.stop(0)


@pytest.mark.parametrize("variant", VARIANTS)
def test_environment_names_are_settings_and_references_resolve(variant, rendered):
    from gateway_svc.config import GatewaySettings
    from loraplane.config import Settings

    settings = {f"LORAPLANE_{name.upper()}" for name in Settings.model_fields} | _read_from_os_environ()
    gateway = {f"LORAPLANE_GATEWAY_{name.upper()}" for name in GatewaySettings.model_fields}
    objects = rendered[variant]
    for (kind, name), obj in objects.items():
        if kind == "ConfigMap":
            for key in obj["data"]:
                assert key in settings, f"ConfigMap {name}: {key} is no LORAPLANE_ setting"
    secrets_documented = _documented_secrets()
    for obj, container in _loraplane_containers(objects):
        for var in container.get("env", []):
            if var["name"].startswith("LORAPLANE_GATEWAY_"):
                assert var["name"] in gateway, var["name"]
            elif var["name"].startswith("LORAPLANE_"):
                assert var["name"] in settings, var["name"]
    for obj in _workloads(objects):
        for container in _containers(obj):
            for var in container.get("env", []):
                ref = var.get("valueFrom", {}).get("secretKeyRef")
                if ref:
                    assert ref["key"] in secrets_documented.get(ref["name"], set()), (
                        f"{_ident(obj)} reads Secret {ref['name']}/{ref['key']}, which docs/deploy.md does not create")
                for source in container.get("envFrom", []):
                    assert ("ConfigMap", source["configMapRef"]["name"]) in objects
        for volume in _pod_specs(obj)[0].get("volumes", []):
            if "secret" in volume:
                assert volume["secret"]["secretName"] in secrets_documented, volume


def _read_from_os_environ() -> set[str]:
    """LORAPLANE_* variables the code reads directly (os.environ / os.getenv) rather than through Settings."""
    names = set()
    for package in ("loraplane", "registry_svc", "trainer_svc", "sampler_svc", "gateway_svc"):
        for path in (ROOT / package).rglob("*.py"):
            names |= set(re.findall(r"(?:environ\.get\(|environ\[|getenv\()\s*[\"'](LORAPLANE_\w+)[\"']",
                                    path.read_text()))
    return names


def _documented_secrets() -> dict[str, set[str]]:
    """`kubectl create secret generic NAME --from-literal=KEY=... --from-file=KEY=...` lines of docs/deploy.md."""
    text = (ROOT / "docs" / "deploy.md").read_text().replace("\\\n", " ")
    out: dict[str, set[str]] = {}
    for match in re.finditer(r"kubectl (?:-n \S+ )?create secret (?:generic|tls) (\S+)([^\n]*)", text):
        keys = set(re.findall(r"--from-(?:literal|file)=([\w.-]+)=", match.group(2)))
        out.setdefault(match.group(1), set()).update(keys)
    return out


@pytest.mark.parametrize("variant", VARIANTS)
def test_images_carry_the_modules_they_run(variant, rendered):
    """A container runs a module only from an image stage of ./Dockerfile that copies its package; the third-party
    images are those docker-compose.yml pins."""
    stages: dict[str, set[str]] = {}
    stage = None
    for line in (ROOT / "Dockerfile").read_text().splitlines():
        if m := re.match(r"FROM \S+ AS (\w+)", line):
            stage = m.group(1)
            stages[stage] = set()
        elif (m := re.match(r"COPY (\w+) ", line)) and stage:
            stages[stage].add(m.group(1))
    for obj, container in _loraplane_containers(rendered[variant]):
        module, _ = _module_and_args(container["command"])
        tag = container["image"].rpartition(":")[2]
        assert module.split(".")[0] in stages[tag], f"{container['image']} lacks {module}"
    compose = yaml.safe_load((ROOT / "docker-compose.yml").read_text())["services"]
    pinned = {compose[s]["image"] for s in ("redis", "minio", "sglang")}
    for obj in _workloads(rendered[variant]):
        for container in _containers(obj):
            if not container["image"].rpartition("/")[2].startswith(LORAPLANE_IMAGE + ":"):
                assert container["image"] in pinned, container["image"]


@pytest.mark.parametrize("variant", VARIANTS)
def test_selectors_budgets_scrapes_and_resources(variant, rendered):
    objects = rendered[variant]
    templates = {_ident(o): o["spec"]["template"]["metadata"]["labels"] for o in _workloads(objects)}

    def selected(selector: dict) -> list:
        return [i for i, labels in templates.items() if all(labels.get(k) == v for k, v in selector.items())]

    for (kind, name), obj in objects.items():
        if kind in ("Deployment", "StatefulSet"):
            assert obj["spec"]["selector"]["matchLabels"].items() <= templates[(kind, name)].items()
            if kind == "StatefulSet":
                assert ("Service", obj["spec"]["serviceName"]) in objects
        elif kind == "Service":
            assert selected(obj["spec"]["selector"]), f"Service {name} selects no pods"
        elif kind == "PodDisruptionBudget":
            assert selected(obj["spec"]["selector"]["matchLabels"]), f"PDB {name} selects no pods"
    for component in ("registry", "trainer", "sampler", "gateway", "redis", "minio"):
        assert any(o["kind"] == "PodDisruptionBudget"
                   and o["spec"]["selector"]["matchLabels"].get("app.kubernetes.io/component") == component
                   for o in objects.values()), f"no PodDisruptionBudget for {component}"
    for obj, container in _loraplane_containers(objects):
        annotations = obj["spec"]["template"]["metadata"].get("annotations", {})
        env = _env(objects, container)
        serves_metrics = any(p.get("name") == "metrics" for p in container.get("ports", []))
        if serves_metrics:
            assert annotations.get("prometheus.io/scrape") == "true"
            assert annotations["prometheus.io/port"] == env["LORAPLANE_METRICS_PORT"] == str(
                _named_port(container, "metrics"))
    for obj in _workloads(objects):
        for container in _containers(obj):
            resources = container.get("resources", {})
            assert resources.get("requests", {}).get("cpu") and resources["requests"].get("memory"), container["name"]
            gpus = resources.get("limits", {}).get("nvidia.com/gpu")
            assert gpus == resources["requests"].get("nvidia.com/gpu"), "GPU requests must equal limits"


@pytest.mark.parametrize("variant", VARIANTS)
def test_sampler_autoscales_on_its_own_gauges(variant, rendered):
    objects = rendered[variant]
    hpa = objects[("HorizontalPodAutoscaler", "loraplane-sampler")]
    target = hpa["spec"]["scaleTargetRef"]
    assert (target["kind"], target["name"]) in objects
    source = (ROOT / "sampler_svc" / "server.py").read_text()
    rules = (K8S / "prometheus-adapter-rules.yaml").read_text()
    names = [m["pods"]["metric"]["name"] for m in hpa["spec"]["metrics"]]
    assert names
    for name in names:
        assert f'"{name}"' in source, f"the sampler registers no gauge {name}"
        assert name in rules, f"prometheus-adapter-rules.yaml does not expose {name}"


NAMESPACE = "loraplane"
POD_INDEX_LABEL = "apps.kubernetes.io/pod-index"


def _expand(value: str, env: dict[str, str]) -> str:
    """Kubernetes' $(VAR) expansion; a reference to an unknown variable stays as written (as the kubelet leaves it)."""
    return re.sub(r"\$\(([A-Za-z_][A-Za-z0-9_]*)\)", lambda m: env.get(m.group(1), m.group(0)), value)


def _pod_env(objects: dict, obj: dict, container: dict, ordinal: int) -> dict[str, str]:
    """The environment the kubelet gives `container` in pod `ordinal` of StatefulSet `obj`: ConfigMaps, then each
    `env` entry in order, expanded against those before it (fieldRefs of the pod; Secrets as `secret:NAME/KEY`)."""
    pod = f"{obj['metadata']['name']}-{ordinal}"
    fields = {"metadata.name": pod, "metadata.namespace": NAMESPACE, "status.podIP": f"10.0.0.{ordinal + 10}",
              f"metadata.labels['{POD_INDEX_LABEL}']": str(ordinal)}
    env: dict[str, str] = {}
    for source in container.get("envFrom", []):
        env.update(objects[("ConfigMap", source["configMapRef"]["name"])]["data"])
    for var in container.get("env", []):
        source = var.get("valueFrom", {})
        if "fieldRef" in source:
            path = source["fieldRef"]["fieldPath"]
            assert path in fields, f"{container['name']}: fieldRef {path} not modelled here"
            env[var["name"]] = fields[path]
        elif "secretKeyRef" in source:
            env[var["name"]] = f"secret:{source['secretKeyRef']['name']}/{source['secretKeyRef']['key']}"
        else:
            env[var["name"]] = _expand(var["value"], env)
    return env


def _in_env(env: dict[str, str], monkeypatch, read):
    """`read()` (Settings, a service's argument parser, whose defaults are settings) in that environment only."""
    with monkeypatch.context() as patch:
        for key in [k for k in os.environ if k.startswith("LORAPLANE_")]:
            patch.delenv(key)
        for key, value in env.items():
            patch.setenv(key, value)
        return read()


def _settings_in(env: dict[str, str], monkeypatch):
    """loraplane's Settings as the process in that environment reads them."""
    from loraplane.config import Settings

    return _in_env(env, monkeypatch, Settings)


@pytest.mark.parametrize("variant", ["gpu", "gpu-tls"])
def test_torchrun_job_spans_the_trainer_pods(variant, rendered):
    """Every trainer of the fleet is its own torchrun job: pod loraplane-trainer-i (rank 0) and
    loraplane-trainer-worker-i meet at loraplane-trainer-i's DNS name under rendezvous id loraplane-trainer-i."""
    from torch.distributed.elastic.rendezvous.dynamic_rendezvous import _NodeDesc
    from torch.distributed.run import get_args_parser

    from trainer_svc.torchrun import parse_args as launch_args

    objects = rendered[variant]
    leader = objects[("StatefulSet", "loraplane-trainer")]
    worker = objects[("StatefulSet", "loraplane-trainer-worker")]
    trainers = leader["spec"]["replicas"]
    assert trainers >= 2, "the gpu overlay deploys a fleet"
    assert worker["spec"]["replicas"] == trainers, "one worker pod per trainer: worker i is trainer i's second node"
    (lead,), (work,) = _containers(leader), _containers(worker)
    assert lead["command"] == work["command"], "every pod of a job runs the same torchrun command"
    headless = leader["spec"]["serviceName"]
    assert worker["spec"]["serviceName"] == headless
    service = objects[("Service", headless)]["spec"]
    assert service["clusterIP"] == "None" and service["publishNotReadyAddresses"] is True
    for obj in (leader, worker):
        labels = obj["spec"]["template"]["metadata"]["labels"]
        assert service["selector"].items() <= labels.items()
    jobs = {}
    for index in range(trainers):
        pods = {}
        for obj, container in ((leader, lead), (worker, work)):
            env = _pod_env(objects, obj, container, index)
            run = get_args_parser().parse_args([_expand(a, env) for a in container["command"][1:]])
            pods[obj["metadata"]["name"]] = (run, env)
        (run, lead_env), (worker_run, _) = pods["loraplane-trainer"], pods["loraplane-trainer-worker"]
        assert vars(run) | {"local_addr": None} == vars(worker_run) | {"local_addr": None}
        assert run.module and run.training_script == "trainer_svc.torchrun"
        launch = launch_args(run.training_script_args)
        assert int(run.nnodes) == 2
        for container in (lead, work):
            assert int(run.nproc_per_node) == int(container["resources"]["limits"]["nvidia.com/gpu"])
        assert (int(run.nnodes) * int(run.nproc_per_node)) % launch.tensor_parallel_size == 0
        # c10d rendezvous on this trainer's rank-0 pod through the headless Service (names exist before readiness).
        host, port = run.rdzv_endpoint.rsplit(":", 1)
        assert run.rdzv_backend == "c10d" and host == f"loraplane-trainer-{index}.{headless}" == run.local_addr
        assert int(port) in [p["port"] for p in service["ports"]]
        assert int(port) in [p["containerPort"] for p in lead["ports"]]
        assert worker_run.local_addr == f"loraplane-trainer-worker-{index}.{headless}"
        # torch's c10d rendezvous ranks nodes in the sorted order of their descriptors (address first:
        # `_mark_rendezvous_complete`), so node 0 (global rank 0) must be the leader's pod, the one with the gRPC
        # port, the probes and the Service.
        participants = [run.local_addr, worker_run.local_addr]
        assert min(_NodeDesc(addr, 1, 0) for addr in reversed(participants)).addr == run.local_addr
        jobs[run.rdzv_id] = run.rdzv_endpoint
        assert launch.port == _named_port(lead, "grpc") and launch.host == "0.0.0.0"
        assert lead_env["LORAPLANE_DEVICE"] == "cuda"
    assert len(jobs) == len(set(jobs.values())) == trainers, "each trainer's job meets apart from the others"
    _check_grpc_probes(variant, "trainer_svc.torchrun", lead, launch_args(
        get_args_parser().parse_args(lead["command"][1:]).training_script_args).port)
    assert not _probe_ports(work), "ranks > 0 serve no gRPC: no gRPC probes on them"
    assert _services_selecting(objects, worker["spec"]["template"]["metadata"]["labels"]) == [
        objects[("Service", headless)]]


def _served_port(container: dict, monkeypatch) -> int:
    command = container["command"]
    if command[0] == "torchrun":
        from torch.distributed.run import get_args_parser

        run = get_args_parser().parse_args(command[1:])
        return _parse_service_args(run.training_script, run.training_script_args, monkeypatch).port
    return _parse_service_args(*_module_and_args(command), monkeypatch).port


@pytest.mark.parametrize("variant", VARIANTS)
def test_trainers_and_samplers_form_fleets_the_gateway_finds(variant, rendered, monkeypatch):
    """Each trainer pod is a member of one trainer fleet under a stable id (its pod name), advertising its own pod's
    DNS name and the port it serves; each sampler pod a replica of one sampler fleet, likewise; the gateway reaches
    any member through the ClusterIP Services and finds live trainers through the same fleet in the same Redis."""
    objects = rendered[variant]
    gateway = objects[("Deployment", "loraplane-gateway")]
    (gw,) = _containers(gateway)
    gateway_env = _pod_env(objects, {"metadata": {"name": "loraplane-gateway"}}, gw, 0)
    gateway_settings = _settings_in(gateway_env, monkeypatch)
    fleets = {}
    for kind, name, fleet_field, id_field, address_field in (
            ("trainer", "loraplane-trainer", "trainer_fleet", "trainer_id", "trainer_advertise_address"),
            ("sampler", "loraplane-sampler", "sampler_fleet", "sampler_id", "sampler_advertise_address")):
        obj = objects[("StatefulSet", name)]
        (container,) = _containers(obj, init=False)
        headless = objects[("Service", obj["spec"]["serviceName"])]["spec"]
        labels = obj["spec"]["template"]["metadata"]["labels"]
        assert headless["clusterIP"] == "None" and headless["selector"].items() <= labels.items()
        port = _served_port(container, monkeypatch)
        assert _named_port(container, "grpc") == port and port in [p["port"] for p in headless["ports"]]
        ids, addresses = set(), set()
        for ordinal in range(max(2, obj["spec"]["replicas"])):
            env = _pod_env(objects, obj, container, ordinal)
            settings = _settings_in(env, monkeypatch)
            pod = f"{name}-{ordinal}"
            member_id = getattr(settings, id_field)
            if kind == "sampler":  # the replica id is the command's --instance-id (LORAPLANE_SAMPLER_ID otherwise)
                argv = [_expand(a, env) for a in _module_and_args(container["command"])[1]]
                args = _in_env(env, monkeypatch,
                               lambda argv=argv: importlib.import_module("sampler_svc.__main__").parse_args(argv))
                member_id = args.instance_id
                assert args.fleet == settings.sampler_fleet
            assert member_id == pod, f"{kind} {pod}: its fleet id must be its stable pod name, got {member_id!r}"
            assert getattr(settings, address_field) == f"{pod}.{obj['spec']['serviceName']}.{NAMESPACE}.svc:{port}"
            assert settings.redis_url == env["LORAPLANE_REDIS_URL"] == "secret:loraplane-redis/url"
            assert "$(" not in "".join(env.values()), f"{pod}: unexpanded variable in {env}"
            ids.add(member_id)
            addresses.add(getattr(settings, address_field))
            fleets.setdefault(kind, set()).add(getattr(settings, fleet_field))
        assert len(ids) == len(addresses) == max(2, obj["spec"]["replicas"])
        # The gateway's one address for the service is the ClusterIP Service in front of every member.
        configured = gateway_env[f"LORAPLANE_GATEWAY_{kind.upper()}_ADDRESS"]
        host, service_port = configured.rsplit(":", 1)
        service = objects[("Service", host)]["spec"]
        assert service.get("clusterIP") != "None" and service["selector"].items() <= labels.items()
        assert _named_port(container, service["ports"][0]["targetPort"]) == port == int(service_port)
    assert all(len(names) == 1 and "" not in names for names in fleets.values()), fleets
    assert fleets["trainer"] != fleets["sampler"], "a fleet name is unique across trainer and sampler fleets"
    # The gateway reads the trainer fleet's heartbeats: the same fleet, in the same Redis.
    assert {gateway_settings.trainer_fleet} == fleets["trainer"]
    assert gateway_settings.redis_url == "secret:loraplane-redis/url"
    assert objects[("PodDisruptionBudget", "loraplane-trainer")]["spec"]["maxUnavailable"] == 1


@pytest.mark.parametrize("variant", ["gpu", "gpu-tls"])
def test_sglang_sidecar_matches_the_sampler(variant, rendered, monkeypatch):
    objects = rendered[variant]
    sampler = objects[("StatefulSet", "loraplane-sampler")]
    pod = _pod_specs(sampler)[0]
    (sglang,) = pod["initContainers"]
    assert sglang["restartPolicy"] == "Always", "SGLang runs as a native sidecar"
    (main,) = pod["containers"]
    args = importlib.import_module("sampler_svc.__main__").parse_args(_module_and_args(main["command"])[1])
    flags = sglang["command"]

    def flag(name: str) -> str:
        return flags[flags.index(name) + 1]

    assert args.engine == "sglang" and args.sglang_url == [f"http://127.0.0.1:{flag('--port')}"]
    assert int(flag("--max-lora-rank")) == args.sglang_max_lora_rank
    assert int(flag("--max-loras-per-batch")) == args.sglang_max_loras_per_batch
    assert int(flag("--max-loaded-loras")) == args.sglang_max_loaded_loras
    env = _env(objects, main)
    assert flag("--model-path") == env["LORAPLANE_BASE_MODEL"]
    mounts = {(m["name"], m["mountPath"]) for m in main["volumeMounts"]}
    side = {(m["name"], m["mountPath"]) for m in sglang["volumeMounts"]}
    # The file transport writes PEFT directories under <data dir>/sglang, where SGLang reads them.
    staging = ("lora-staging", f"{env['LORAPLANE_DATA_DIR']}/sglang")
    assert args.sglang_adapter_transport == "file" and staging in mounts and staging in side
    model_mount = next(m for m in main["volumeMounts"] if env["LORAPLANE_BASE_MODEL"].startswith(m["mountPath"] + "/"))
    assert (model_mount["name"], model_mount["mountPath"]) in side
    assert {p["port"] for p in objects[("NetworkPolicy", "loraplane-sampler")]["spec"]["ingress"][0]["ports"]} == {
        _named_port(main, "grpc"), _named_port(main, "metrics")}
    for kind in ("startupProbe", "livenessProbe"):
        assert sglang[kind]["httpGet"] == {"path": "/health", "port": int(flag("--port"))}
    # Logprobs of the unscaled distribution, as the sampler serves them (sampler_svc/engines/sglang_servers.py).
    assert {"name": "SGLANG_RETURN_ORIGINAL_LOGPROB", "value": "True"} in sglang["env"]


def test_bundled_redis_keeps_an_aof_with_fsync_always(rendered):
    redis = rendered["cpu"][("StatefulSet", "loraplane-redis")]
    (container,) = _containers(redis)
    command = container["command"]
    assert command[command.index("--appendonly") + 1] == "yes"
    assert command[command.index("--appendfsync") + 1] == "always"
    assert {m["mountPath"] for m in container["volumeMounts"]} == {"/data"}
    assert redis["spec"]["volumeClaimTemplates"][0]["metadata"]["name"] == "data"
    config = rendered["cpu"][("ConfigMap", "loraplane-config")]["data"]
    minio = rendered["cpu"][("Service", "loraplane-minio")]["spec"]["ports"][0]["port"]
    assert config["LORAPLANE_S3_ENDPOINT"] == f"loraplane-minio:{minio}"
