"""The product CLI commands against a real registry, trainer and sampler (tiny model), through typer's CliRunner."""

from __future__ import annotations

import json
import re
import threading

import pytest
from typer.testing import CliRunner

from loraplane.client import AdamParams, ServiceClient, datum_from_sequence
from loraplane_cli import app

runner = CliRunner()


@pytest.fixture
def published(registry, trainer, sampler):
    """An adapter with two weights versions, trained for real."""
    service = ServiceClient(trainer=trainer.address, sampler=sampler.address, registry=registry.address)
    training = service.create_lora_training_client("tiny", rank=4, seed=4, name="team/cli-demo")
    datum = datum_from_sequence(list(range(10, 40)))
    for _ in range(2):
        training.forward_backward([datum]).result(60)
        training.optim_step(AdamParams(learning_rate=1e-2)).result(60)
        training.save_weights_for_sampler().result(60)
    return registry, trainer, sampler


def invoke(*args: str):
    result = runner.invoke(app, list(args), catch_exceptions=False)
    return result


def test_adapters_ls_show_versions(published):
    registry, _, _ = published
    ls = invoke("adapters", "ls", "--registry", registry.address)
    assert ls.exit_code == 0, ls.output
    assert "team/cli-demo" in ls.output and "v2" in ls.output and "tiny" in ls.output
    only_other = invoke("adapters", "ls", "--prefix", "other/", "--registry", registry.address)
    assert "team/cli-demo" not in only_other.output and "adapters (0)" in only_other.output

    show = invoke("adapters", "show", "team/cli-demo", "--registry", registry.address)
    assert show.exit_code == 0, show.output
    assert "rank / alpha" in show.output and "4 / 4" in show.output
    assert "weights versions" in show.output and "2" in show.output

    versions = invoke("adapters", "versions", "team/cli-demo", "--registry", registry.address)
    assert versions.exit_code == 0, versions.output
    assert "v1" in versions.output and "v2" in versions.output and "weights" in versions.output
    states = invoke("adapters", "versions", "team/cli-demo", "--kind", "state", "--registry", registry.address)
    assert "0 versions" in states.output


def test_alias_and_rm(published, monkeypatch):
    registry, _, _ = published
    # Addresses may come from the environment instead of options.
    monkeypatch.setenv("LORAPLANE_REGISTRY_ADDRESS", registry.address)
    alias = invoke("adapters", "alias", "team/cli-demo", "prod", "1")
    assert alias.exit_code == 0, alias.output
    assert "team/cli-demo@prod → v1" in alias.output
    assert "prod→v1" in invoke("adapters", "show", "team/cli-demo").output

    rm_version = invoke("adapters", "rm", "team/cli-demo", "--version", "2", "--yes")
    assert rm_version.exit_code == 0 and "deleted version 2" in rm_version.output
    assert "v2" not in invoke("adapters", "versions", "team/cli-demo").output

    refused = runner.invoke(app, ["adapters", "rm", "team/cli-demo"], input="n\n")
    assert refused.exit_code == 1
    assert "team/cli-demo" in invoke("adapters", "ls").output
    rm = invoke("adapters", "rm", "team/cli-demo", "--yes")
    assert rm.exit_code == 0, rm.output
    assert "team/cli-demo" not in invoke("adapters", "ls").output

    missing = runner.invoke(app, ["adapters", "show", "team/cli-demo"])
    assert missing.exit_code == 1
    assert "NOT_FOUND" in missing.output


def test_sample_prints_text_of_the_requested_version(published):
    _, trainer, sampler = published
    args = ["--trainer", trainer.address, "--sampler", sampler.address, "--max-tokens", "5", "--raw"]
    base = invoke("sample", "hello", *args)
    v1 = invoke("sample", "hello", "--adapter", "team/cli-demo", "--version", "1", *args)
    latest = invoke("sample", "hello", "--adapter", "team/cli-demo", "-n", "2", "--temperature", "1.0",
                    "--seed", "5", *args)
    for result in (base, v1, latest):
        assert result.exit_code == 0, result.output
    assert "base model" in base.output
    assert "team/cli-demo@v1" in v1.output
    assert "team/cli-demo@v2 #1" in latest.output and "team/cli-demo@v2 #2" in latest.output
    # The generated text is printed (the line after the header is not empty for 5 tokens of the byte tokenizer).
    assert len(v1.output.strip().splitlines()) >= 2
    chat = invoke("sample", "hello", "--adapter", "team/cli-demo", "--chat", "--trainer", trainer.address,
                  "--sampler", sampler.address, "--max-tokens", "3")
    assert chat.exit_code == 0 and "team/cli-demo@v2" in chat.output
    unknown = runner.invoke(app, ["sample", "hi", "--adapter", "team/none", *args])
    assert unknown.exit_code == 1 and "NOT_FOUND" in unknown.output


def test_watch_prints_history_and_live_events(published):
    registry, _, _ = published
    history = invoke("watch", "--from-start", "--max-events", "3", "--timeout", "30", "--registry", registry.address)
    assert history.exit_code == 0, history.output
    lines = [line for line in history.output.splitlines() if "team/cli-demo" in line]
    assert len(lines) == 3
    assert "created" in lines[0] and "published" in lines[1] and "v1" in lines[1] and "v2" in lines[2]

    service = ServiceClient(registry=registry.address)
    stop = threading.Event()

    def keep_setting_alias():
        # Repeated until the watcher has seen one: the watch starts at the end of the stream, whenever it connects.
        while not stop.wait(0.5):
            service.set_alias("team/cli-demo", "live", 2)

    threading.Thread(target=keep_setting_alias, daemon=True).start()
    try:
        live = invoke("watch", "--adapter", "team/cli-demo", "--max-events", "1", "--timeout", "30",
                      "--registry", registry.address)
    finally:
        stop.set()
    assert live.exit_code == 0, live.output
    assert "alias" in live.output and "live → v2" in live.output


def test_missing_addresses_fail_cleanly(monkeypatch, tmp_path):
    monkeypatch.delenv("LORAPLANE_REGISTRY_ADDRESS", raising=False)
    monkeypatch.setenv("LORAPLANE_DATA_DIR", str(tmp_path))
    result = runner.invoke(app, ["adapters", "ls"])
    assert result.exit_code == 1
    assert "no registry address" in result.output


def test_addresses_come_from_the_cluster_state_file(published, monkeypatch, tmp_path):
    registry, _, _ = published
    monkeypatch.delenv("LORAPLANE_REGISTRY_ADDRESS", raising=False)
    state = {"data_dir": str(tmp_path), "started_at": 0.0,
             "components": [{"name": "registry", "kind": "service", "endpoint": registry.address, "pid": None,
                             "log": ""}]}
    (tmp_path / "cluster.json").write_text(json.dumps(state))
    result = invoke("adapters", "ls", "--data-dir", str(tmp_path))
    assert result.exit_code == 0, result.output
    assert "team/cli-demo" in result.output


def test_bench_lists_and_rejects_unknown(tmp_path, monkeypatch):
    bench = tmp_path / "bench"
    bench.mkdir()
    (bench / "echo_numbers.py").write_text('"""Prints one JSON line."""\nimport json\nprint(json.dumps({"ok": 1}))\n')
    monkeypatch.chdir(tmp_path)
    listing = invoke("bench")
    assert listing.exit_code == 0 and "echo_numbers" in listing.output and "Prints one JSON line." in listing.output
    ran = runner.invoke(app, ["bench", "echo_numbers"])
    assert ran.exit_code == 0, ran.output
    unknown = runner.invoke(app, ["bench", "nope"])
    assert unknown.exit_code == 2 and "no benchmark 'nope'" in unknown.output


def test_demo_quick_runs_two_tenants_on_its_own_cluster(tmp_path):
    """`loraplane demo --quick`: starts an embedded cluster (its own Valkey + SeaweedFS), trains both tenants on the
    tiny model, publishes versions, samples them and writes the plot and log."""
    out = tmp_path / "demo"
    result = runner.invoke(app, ["demo", "--quick", "--no-live", "--out", str(out)], catch_exceptions=False)
    assert result.exit_code == 0, result.output
    log = json.loads((out / "demo_log.json").read_text())
    assert set(log["tenants"]) == {"acme/french", "globex/caps"}
    for tenant in log["tenants"].values():
        assert tenant["error"] == ""
        assert len(tenant["losses"]) == 4
        assert tenant["losses"][-1] < tenant["losses"][0]
        assert [v["version"] for v in tenant["versions"]] == [1, 2]
    png = (out / "demo_losses.png").read_bytes()
    assert png.startswith(b"\x89PNG") and len(png) > 10_000
    assert "acme/french v2" in result.output and "globex/caps v2" in result.output


def test_quickstart_example_trains_publishes_and_samples(published, monkeypatch):
    registry, trainer, sampler = published
    for name, live in (("REGISTRY", registry), ("TRAINER", trainer), ("SAMPLER", sampler)):
        monkeypatch.setenv(f"LORAPLANE_{name}_ADDRESS", live.address)
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parents[2] / "examples" / "quickstart.py"
    spec = importlib.util.spec_from_file_location("quickstart_example", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    result = module.main(["--steps", "6", "--learning-rate", "2e-2"])
    assert result["losses"][-1] < result["losses"][0] * 0.5
    assert result["version"] == 1 and result["served_version"] == 1


def test_train_fine_tunes_from_a_jsonl_file_publishes_and_plots(registry, trainer, sampler, tmp_path):
    data = tmp_path / "pairs.jsonl"
    data.write_text("\n".join(json.dumps({"prompt": f"colour {i}?", "completion": "blue"}) for i in range(3)) + "\n")
    plot = tmp_path / "loss.png"
    addresses = ["--registry", registry.address, "--trainer", trainer.address, "--sampler", sampler.address]
    result = invoke("train", str(data), "--adapter", "team/cli-train", "--steps", "6", "--lr", "5e-2", "--rank", "4",
                    "--batch-size", "3", "--plot", str(plot), *addresses)
    assert result.exit_code == 0, result.output
    match = re.search(r"loss\s+([0-9.]+)\s+->\s+([0-9.]+)\s+over\s+6\s+steps", result.output)
    assert match and float(match[2]) < float(match[1]) * 0.8, result.output
    assert "team/cli-train@v1" in result.output and plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    service = ServiceClient(trainer=trainer.address, sampler=sampler.address, registry=registry.address)
    assert service.get_version("team/cli-train", alias="latest-train").version == 1
    sampled = invoke("sample", "colour 1?", "--adapter", "team/cli-train", "--max-tokens", "3", *addresses[2:])
    assert sampled.exit_code == 0 and "team/cli-train@v1" in sampled.output


def test_train_rejects_a_malformed_file_naming_the_line(tmp_path):
    """Tried: a line that is not JSON, and a line without a completion; both are usage errors naming the line,
    raised before any service is contacted (no addresses are given)."""
    for body, line in (('{"prompt": "a", "completion": "b"}\nnot json\n', 2), ('{"prompt": "a"}\n', 1)):
        data = tmp_path / f"bad{line}.jsonl"
        data.write_text(body)
        result = runner.invoke(app, ["train", str(data), "--adapter", "x"])
        assert result.exit_code == 2 and f"line {line}" in result.output, result.output
