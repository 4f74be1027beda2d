"""The dependency arrows point one way (docs/architecture.md): CLI / demo / local cluster (loraplane_cli) ->
services (registry_svc, trainer_svc, sampler_svc, gateway_svc) -> shared library (loraplane). This test reads every
import statement of the repository's packages (module level, inside functions and under TYPE_CHECKING alike) and
fails when a lower layer imports a higher one, when one service imports another (they talk over gRPC), or when the
client modules import each other in a circle, or when the domain code of the trainer (service, scheduler) or of the
sampler (everything but its servicer and server) imports the protobuf stubs (the servicer converts the wire to domain
dataclasses and back)."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
LIBRARY = "loraplane"
SERVICES = ("registry_svc", "trainer_svc", "sampler_svc", "gateway_svc")
TOP = "loraplane_cli"


def package_of(module: str) -> str:
    return module.split(".")[0]


def imports_of(path: Path) -> set[str]:
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.add(node.module)
            found.update(f"{node.module}.{alias.name}" for alias in node.names)
    return found


def modules(package: str) -> dict[str, Path]:
    base = ROOT / package
    return {".".join(p.relative_to(ROOT).with_suffix("").parts): p for p in base.rglob("*.py")
            if "__pycache__" not in p.parts}


def test_the_shared_library_imports_no_service_and_no_cli():
    offenders = {module: sorted(i for i in imports_of(path) if package_of(i) in (*SERVICES, TOP))
                 for module, path in modules(LIBRARY).items()}
    assert {m: i for m, i in offenders.items() if i} == {}


def test_services_import_neither_the_cli_nor_each_other():
    offenders = {}
    for service in SERVICES:
        if not (ROOT / service).is_dir():
            continue
        for module, path in modules(service).items():
            bad = sorted(i for i in imports_of(path) if package_of(i) in {*SERVICES, TOP} - {service})
            if bad:
                offenders[module] = bad
    assert offenders == {}


def test_the_client_modules_import_each_other_without_a_circle():
    graph = {module: {i for i in imports_of(path) if i in modules(LIBRARY) and i.startswith("loraplane.client.")}
             for module, path in modules(LIBRARY).items() if module.startswith("loraplane.client.")}
    done: set[str] = set()

    def visit(module: str, stack: tuple[str, ...]) -> None:
        assert module not in stack, f"import circle: {' -> '.join((*stack, module))}"
        if module in done:
            return
        for target in graph.get(module, ()):
            visit(target, (*stack, module))
        done.add(module)

    for module in graph:
        visit(module, ())


WIRE = "loraplane.v1"
# In the trainer and the sampler only the servicer and the process wiring (server, __main__) may touch the wire; any
# module added to either service is domain code. (What publish returns to the trainer, a protobuf AdapterVersion,
# passes through its service untouched, named via loraplane.registry_client.)
WIRE_SIDE = ("servicer.py", "server.py", "__main__.py")
TRAINER_WIRE_SIDE = tuple(f"trainer_svc/{name}" for name in WIRE_SIDE)
SAMPLER_WIRE_SIDE = tuple(f"sampler_svc/{name}" for name in WIRE_SIDE)


def wire_free(service: str) -> list[str]:
    return sorted(path.relative_to(ROOT).as_posix() for path in modules(service).values()
                  if path.relative_to(ROOT).name not in WIRE_SIDE or path.parent != ROOT / service)


def wire_imports(paths) -> dict[str, list[str]]:
    offenders = {path: sorted(i for i in imports_of(ROOT / path) if i == WIRE or i.startswith(WIRE + "."))
                 for path in paths}
    return {p: i for p, i in offenders.items() if i}


def test_the_trainer_domain_imports_no_protobuf_stubs():
    assert wire_imports(wire_free("trainer_svc")) == {}


def test_the_sampler_domain_imports_no_protobuf_stubs():
    assert wire_imports(wire_free("sampler_svc")) == {}


def test_this_test_sees_the_arrows_it_guards():
    # The checks above would pass vacuously if the import reader found nothing.
    assert "loraplane.client._session" in imports_of(ROOT / "loraplane/client/service_client.py")
    assert any(package_of(i) == "trainer_svc" for path in modules(TOP).values() for i in imports_of(path))
    assert "loraplane.v1.common_pb2" in imports_of(ROOT / "trainer_svc/servicer.py")
    assert "loraplane.v1.sampler_pb2" in imports_of(ROOT / "sampler_svc/servicer.py")
    assert all((ROOT / path).is_file() for path in (*TRAINER_WIRE_SIDE, *SAMPLER_WIRE_SIDE))
    assert {"sampler_svc/adapter_manager.py", "sampler_svc/service.py",
            "sampler_svc/engines/torch_engine.py"} <= set(wire_free("sampler_svc"))
    assert {"trainer_svc/service.py", "trainer_svc/scheduler.py", "trainer_svc/validation.py",
            "trainer_svc/backends/megatron/backend.py"} <= set(wire_free("trainer_svc"))
    assert not set(wire_free("trainer_svc")) & set(TRAINER_WIRE_SIDE)
