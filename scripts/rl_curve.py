"""The reward curve of tinker-cookbook's `math_rl` recipe (env=arithmetic, its default loss stable_reinforce),
unmodified, against a local loraplane cluster started here (`loraplane up`: Valkey, SeaweedFS, registry, trainer,
sampler, gateway on loopback). Writes the per-step reward and where each step's time went (sampling, training,
publishing the new weights to the sampler) as JSON and a PNG.

    .venv/bin/python scripts/rl_curve.py                       # SmolLM2-135M-Instruct, the H100 settings
    .venv/bin/python scripts/rl_curve.py --preset cpu          # small batches that finish on a laptop CPU

Everything the recipe is given is configuration (command-line keys and environment variables); the recipe's own
timing metrics (`time/sampling`, `time/train_step`, `time/save_checkpoint_and_get_sampling_client`) give the split.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
BIN = Path(sys.executable).parent
# The installed `loraplane` script, or the same entry point from a source tree (the GPU machine runs from one).
CLI = ([str(BIN / "loraplane")] if (BIN / "loraplane").exists()
       else [sys.executable, "-c", "import sys; from loraplane_cli import app; sys.argv[0] = 'loraplane'; app()"])
PRESETS = {
    # groups_per_batch x group_size rollouts per step.
    "gpu": {"steps": 60, "group_size": 16, "groups_per_batch": 32, "learning_rate": 3e-4, "lora_rank": 16},
    "cpu": {"steps": 30, "group_size": 8, "groups_per_batch": 8, "learning_rate": 1e-3, "lora_rank": 8},
}
# Renderers the cookbook has for a model family's chat template (SmolLM2 speaks ChatML, as Qwen does).
RENDERERS = {"smollm2-135m-instruct": "qwen3_instruct"}
TIME_KEYS = {"sampling": "time/sampling", "training": "time/train_step",
             "publish": "time/save_checkpoint_and_get_sampling_client", "total": "time/total"}


def model_dir(name: str) -> Path:
    """The local HF directory the recipe takes its tokenizer from (the served model's own files)."""
    if name == "smollm2-135m-instruct":
        from loraplane.models.base import ensure_smollm2_cache

        return ensure_smollm2_cache()
    return Path(name).resolve()


def up(data_dir: Path, base_model: str, names: str) -> str:
    env = {**os.environ, "LORAPLANE_GATEWAY_MODEL_NAMES": names}
    out = subprocess.run([*CLI, "up", "--no-auth", "--data-dir", str(data_dir),
                          "--base-model", base_model], check=False, env=env, capture_output=True, text=True,
                         timeout=900)
    if out.returncode != 0:
        raise SystemExit(f"loraplane up failed:\n{out.stdout}\n{out.stderr}")
    found = re.search(r"TINKER_BASE_URL=(\S+)", out.stdout + out.stderr)
    if not found:
        raise SystemExit(f"loraplane up printed no TINKER_BASE_URL:\n{out.stdout}\n{out.stderr}")
    return found.group(1)


def down(data_dir: Path) -> None:
    subprocess.run([*CLI, "down", "--data-dir", str(data_dir)], check=False, capture_output=True,
                   timeout=120)


def run_recipe(base_url: str, model: Path, renderer: str, log_dir: Path, cfg: dict, budget_s: float | None) -> float:
    """Runs the recipe to its last step, or stops it once budget_s has passed (the steps logged so far are kept:
    a device call has a wall-clock limit)."""
    args = [sys.executable, "-m", "tinker_cookbook.recipes.math_rl.train", "env=arithmetic", f"model_name={model}",
            f"renderer_name={renderer}", f"log_path={log_dir}", "behavior_if_log_dir_exists=delete",
            f"group_size={cfg['group_size']}", f"groups_per_batch={cfg['groups_per_batch']}",
            f"learning_rate={cfg['learning_rate']}", f"lora_rank={cfg['lora_rank']}", f"max_steps={cfg['steps']}",
            f"max_tokens={cfg['max_tokens']}", "eval_every=0", "save_every=0"]
    env = {**os.environ, "TINKER_BASE_URL": base_url, "TINKER_API_KEY": "tml-local", "TINKER_TELEMETRY": "0",
           "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
    started = time.monotonic()
    output = log_dir.parent / "recipe-output.log"
    log_dir.parent.mkdir(parents=True, exist_ok=True)
    # Its own process group, output to a file: on the budget the whole group is killed at once, and nothing a
    # surviving grandchild holds (a pipe) can keep this process waiting.
    with output.open("w") as sink:
        proc = subprocess.Popen(args, env=env, stdout=sink, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            code = proc.wait(timeout=budget_s)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            print(f"stopped math_rl at its {budget_s:.0f} s budget", flush=True)
            return time.monotonic() - started
    if code != 0:
        raise SystemExit(f"math_rl failed:\n{output.read_text()[-8000:]}")
    return time.monotonic() - started


def summarize(log_dir: Path, cfg: dict, wall_s: float, device: str) -> dict:
    rows = [json.loads(line) for line in (log_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    steps = [r for r in rows if "env/all/reward/total" in r]
    per_step = [{"step": r["step"], "reward": r["env/all/reward/total"], "correct": r.get("env/all/correct"),
                 "format": r.get("env/all/format"), **{k: r.get(v) for k, v in TIME_KEYS.items()}}
                for r in steps]
    first, last = per_step[: max(1, len(per_step) // 5)], per_step[-max(1, len(per_step) // 5):]

    def mean(xs):
        xs = [x for x in xs if x is not None]
        return sum(xs) / len(xs) if xs else None
    return {"recipe": "tinker_cookbook.recipes.math_rl.train env=arithmetic (default loss: stable_reinforce)",
            "config": cfg, "device": device, "wall_s": round(wall_s, 1), "steps": per_step,
            "reward_first_fifth": mean(r["reward"] for r in first), "reward_last_fifth": mean(r["reward"] for r in last),
            "mean_time_s": {k: mean(r[k] for r in per_step[1:] or per_step) for k in TIME_KEYS}}


def plot(summary: dict, png: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    steps = [r["step"] for r in summary["steps"]]
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4))
    ax1.plot(steps, [r["reward"] for r in summary["steps"]], marker="o", label="reward")
    if all(r["correct"] is not None for r in summary["steps"]):
        ax1.plot(steps, [r["correct"] for r in summary["steps"]], marker=".", alpha=0.6, label="correct")
    if all(r["format"] is not None for r in summary["steps"]):
        fmt = ax1.twinx()
        fmt.plot(steps, [r["format"] for r in summary["steps"]], linestyle="--", color="grey", label="well-formed")
        fmt.set_ylabel("fraction well-formed (ends with the stop token)")
        fmt.set_ylim(0, 1.05)
        fmt.legend(loc="lower right")
    ax1.set_xlabel("step")
    ax1.set_ylabel("mean over the batch")
    ax1.set_title(f"math_rl arithmetic, {summary['config']['model']} ({summary['device']})")
    ax1.legend(loc="center right")
    bottom = [0.0] * len(steps)
    for key in ("sampling", "training", "publish"):
        values = [r[key] or 0.0 for r in summary["steps"]]
        ax2.bar(steps, values, bottom=bottom, label=key)
        bottom = [b + v for b, v in zip(bottom, values)]
    ax2.set_xlabel("step")
    ax2.set_ylabel("seconds")
    ax2.set_title("time per step")
    ax2.legend()
    fig.tight_layout()
    fig.savefig(png, dpi=100)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", choices=sorted(PRESETS), default="gpu")
    parser.add_argument("--model", default="smollm2-135m-instruct", help="served base model (name or HF dir)")
    parser.add_argument("--renderer", default=None, help="cookbook renderer (default: by model)")
    parser.add_argument("--steps", type=int)
    parser.add_argument("--group-size", type=int)
    parser.add_argument("--groups-per-batch", type=int)
    parser.add_argument("--learning-rate", type=float)
    parser.add_argument("--lora-rank", type=int)
    parser.add_argument("--max-tokens", type=int, default=5)
    parser.add_argument("--budget-s", type=float, help="stop the recipe after this many seconds, keeping its steps")
    parser.add_argument("--from-log", help="only summarize and plot a finished run's recipe log dir "
                        "(its metrics.jsonl), e.g. one kept with --keep-logs")
    parser.add_argument("--device-name", default=None, help="with --from-log: the device the run used")
    parser.add_argument("--keep-logs", help="copy the services' and the recipe's logs here before cleaning up")
    parser.add_argument("--out", default=str(ROOT / "docs" / "rl_curve"), help="writes <out>.json and <out>.png")
    args = parser.parse_args()
    cfg = dict(PRESETS[args.preset])
    for key in ("steps", "group_size", "groups_per_batch", "learning_rate", "lora_rank"):
        if getattr(args, key) is not None:
            cfg[key] = getattr(args, key)
    cfg.update(max_tokens=args.max_tokens, model=args.model, preset=args.preset)
    renderer = args.renderer or RENDERERS.get(args.model, "role_colon")

    if args.from_log:
        log_dir = Path(args.from_log)
        wall = sum(r["total"] or 0.0 for r in summarize(log_dir, cfg, 0.0, "")["steps"])
        return write(summarize(log_dir, cfg, wall, args.device_name or "unknown"), Path(args.out))

    import torch

    device = (f"GPU {torch.cuda.get_device_name(0)}" if torch.cuda.is_available()
              else f"CPU ({os.cpu_count()} cores, {platform.processor() or platform.machine()})")
    model = model_dir(args.model)
    work = Path(tempfile.mkdtemp(prefix="lp-rl-curve-"))
    data_dir = work / "cluster"
    try:
        base_url = up(data_dir, args.model, str(model))
        print(f"cluster up at {base_url}; running math_rl ({cfg})", flush=True)
        wall = run_recipe(base_url, model, renderer, work / "log", cfg, args.budget_s)
    finally:
        down(data_dir)
        if args.keep_logs:  # also when the recipe failed: the services' logs say why
            for src, name in ((data_dir / "logs", "cluster"), (work / "log", "recipe")):
                if src.exists():
                    shutil.copytree(src, Path(args.keep_logs) / name, dirs_exist_ok=True)
            if (work / "recipe-output.log").exists():
                shutil.copy(work / "recipe-output.log", Path(args.keep_logs) / "recipe-output.log")
            for log in data_dir.glob("**/sglang/server-*.log"):  # a sampler's SGLang servers (not their model copy)
                shutil.copy(log, Path(args.keep_logs) / "cluster" / f"sglang-{log.name}")
    summary = summarize(work / "log", cfg, wall, device)
    shutil.rmtree(work, ignore_errors=True)
    write(summary, Path(args.out))


def write(summary: dict, out: Path) -> None:
    out.with_suffix(".json").write_text(json.dumps(summary, indent=1) + "\n")
    plot(summary, out.with_suffix(".png"))
    print(json.dumps({k: v for k, v in summary.items() if k != "steps"}, indent=1))


if __name__ == "__main__":
    main()
