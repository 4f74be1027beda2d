"""What a launched SGLang server process is given beside its arguments: the out-of-tree model package
(sampler_svc/engines/sglang_models: LoRA on text-only Qwen3.5 checkpoints), importable from the server's own
environment. SGLang cannot run on this CPU machine, so `python -m sglang.launch_server` resolves to a stand-in
module (the test says so) that records what the real one would read: its environment and whether the package
named there imports; the launch itself is the engine's real code and a real process."""

from __future__ import annotations

import json
import time

from sampler_svc.engines.sglang_servers import EXTERNAL_MODELS, ServerLauncher, SGLangHTTP

STAND_IN = """
import importlib.util, json, os, sys
package = os.environ.get("SGLANG_EXTERNAL_MODEL_PACKAGE", "")
found = importlib.util.find_spec(package) is not None if package else False
with open(os.environ["STAND_IN_REPORT"], "w") as out:
    json.dump({"package": package, "found": found, "argv": sys.argv[1:]}, out)
"""


def _launch(tmp_path, monkeypatch, **env) -> dict:
    fake = tmp_path / "fake" / "sglang"
    fake.mkdir(parents=True)
    (fake / "__init__.py").write_text("")
    (fake / "launch_server.py").write_text(STAND_IN)
    report = tmp_path / "report.json"
    # Only the stand-in's directory on the path: the project root must come from the launcher itself.
    monkeypatch.setenv("PYTHONPATH", str(fake.parent))
    monkeypatch.setenv("STAND_IN_REPORT", str(report))
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    monkeypatch.chdir(tmp_path)
    launcher = ServerLauncher(http=SGLangHTTP(), work_dir=tmp_path / "work")
    launcher.work_dir.mkdir()
    server = launcher._launch_server(tmp_path / "model", 0)
    assert server.process.wait(timeout=60) == 0, (launcher.work_dir / "server-0.log").read_text()
    deadline = time.monotonic() + 10
    while not report.exists() and time.monotonic() < deadline:
        time.sleep(0.05)
    return json.loads(report.read_text())


def test_a_launched_server_loads_our_model_classes(tmp_path, monkeypatch):
    monkeypatch.delenv("SGLANG_EXTERNAL_MODEL_PACKAGE", raising=False)
    seen = _launch(tmp_path, monkeypatch)
    assert seen["package"] == EXTERNAL_MODELS
    assert seen["found"], "the package is not importable in the server's environment"
    assert "--enable-lora" in seen["argv"]


def test_an_operators_own_model_package_is_kept(tmp_path, monkeypatch):
    seen = _launch(tmp_path, monkeypatch, SGLANG_EXTERNAL_MODEL_PACKAGE="json")
    assert (seen["package"], seen["found"]) == ("json", True)
