"""The megatron backend's MoE code in layers (issue 35, DESIGN.md "Mixture-of-experts"): the grouped-GEMM kernels at
the bottom, the expert LoRA on them, the MoE layer on that, the dense LoRA apart, and no import circle among the
backend's modules (counting the imports inside functions, which is how a circle used to hide)."""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[2] / "trainer_svc" / "backends" / "megatron"


def _internal_imports() -> dict[str, set[str]]:
    graph = {}
    for path in PACKAGE.rglob("*.py"):
        name = path.relative_to(PACKAGE).with_suffix("").as_posix().replace("/", ".")
        found = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.level == 1:
                if node.module:
                    found.add(node.module.split(".")[0])
                else:
                    found.update(a.name for a in node.names)
            elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith("trainer_svc.backends.megatron."):
                found.add(node.module.split(".")[3])
        graph[name] = found - {name}
    return graph


def test_no_import_circle_among_the_backend_modules():
    graph = _internal_imports()
    done, path = set(), []

    def visit(module):
        assert module not in path, f"import circle: {' -> '.join([*path[path.index(module):], module])}"
        if module in done or module not in graph:
            return
        path.append(module)
        for dep in sorted(graph[module]):
            visit(dep)
        path.pop()
        done.add(module)

    for module in sorted(graph):
        visit(module)


def test_kernels_at_the_bottom_expert_lora_on_them_the_moe_layer_on_that():
    graph = _internal_imports()
    kernels = {"kernels", "fused_expert_lora"}  # the grouped-GEMM primitives and the fused expert-LoRA kernel
    assert all(graph[k] == set() for k in kernels) and graph["routing"] == set()
    assert graph["expert_lora"] <= kernels | {"routing", "layout"}
    assert "lora" not in graph["moe"] and graph["moe"] <= kernels | {"routing", "expert_lora", "layout"}
    assert "moe" not in graph["lora"] and "moe" not in graph["expert_lora"]
