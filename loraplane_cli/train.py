"""`loraplane train`: supervised fine-tuning of one adapter from the shell, on a running cluster.

    loraplane train data.jsonl --adapter me/support-bot --steps 30 --lr 1e-3
    loraplane sample "How do I reset my password?" --adapter me/support-bot

Each line of the JSONL file is {"prompt": ..., "completion": ...}. The prompt is wrapped in the base model's chat
template (as `loraplane sample` does) and weighs nothing; the completion and its end-of-turn token are learned
(per-example mean, so long and short completions count alike). The run ends by publishing a version (and moving
the `latest-train` alias to it) and writing a loss plot.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

import typer
from rich.console import Console
from rich.progress import BarColumn, Progress, TextColumn, TimeRemainingColumn

from loraplane.client import AdamParams, APIError
from loraplane_cli.app import app
from loraplane_cli.common import plot_losses, sft_datum
from loraplane_cli.product import DataDirOption, RegistryOption, SamplerOption, TrainerOption, _fail, _service

console = Console()
DataArgument = typer.Argument(..., help="JSONL file of {\"prompt\", \"completion\"} lines.")
PlotOption = typer.Option(None, help="Loss plot PNG (default: <adapter>-loss.png, '/' -> '_').")


def read_examples(path: Path) -> list[tuple[str, str]]:
    """(prompt, completion) pairs; a malformed line is a usage error naming its line number."""
    examples = []
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except (OSError, UnicodeDecodeError) as exc:
        raise typer.BadParameter(f"cannot read {path}: {exc}", param_hint="DATA") from None
    for number, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except ValueError:
            raise typer.BadParameter(f"line {number} is not JSON", param_hint="DATA") from None
        if not (isinstance(record, dict) and isinstance(record.get("prompt"), str)
                and isinstance(record.get("completion"), str) and record["completion"]):
            raise typer.BadParameter(f'line {number} needs string "prompt" and non-empty "completion" fields',
                                     param_hint="DATA")
        examples.append((record["prompt"], record["completion"]))
    if not examples:
        raise typer.BadParameter(f"{path} holds no examples", param_hint="DATA")
    return examples


@app.command()
def train(data: Path = DataArgument,
          adapter: str = typer.Option(..., "--adapter", "-a", help="Adapter name (created, or continued if it "
                                                                     "exists on the trainer)."),
          steps: int = typer.Option(20, min=1, help="Optimizer steps."),
          lr: float = typer.Option(1e-3, "--lr", min=0.0, help="AdamW learning rate."),
          rank: int = typer.Option(16, min=1, help="LoRA rank of a new adapter."),
          batch_size: int = typer.Option(8, min=1, help="Examples per step."),
          seed: int = typer.Option(0, help="Adapter initialisation and batch order."),
          plot: Path = PlotOption,
          registry: str = RegistryOption, trainer: str = TrainerOption, sampler: str = SamplerOption,
          data_dir: Path = DataDirOption) -> None:
    """Fine-tune an adapter on prompt/completion pairs, publish it, and plot the loss."""
    if lr <= 0:
        raise typer.BadParameter("must be > 0", param_hint="--lr")
    examples = read_examples(data)
    service = _service(registry, trainer, sampler, data_dir)
    try:
        training = service.create_lora_training_client(rank=rank, alpha=2 * rank, seed=seed, name=adapter,
                                                       exist_ok=True)
        tokenizer = training.get_tokenizer()
        datums = [sft_datum(tokenizer, prompt, completion) for prompt, completion in examples]
        rng = random.Random(seed)
        adam = AdamParams(learning_rate=lr)
        losses: list[float] = []
        columns = (TextColumn("[bold]{task.description}"), BarColumn(), TextColumn("{task.completed}/{task.total}"),
                   TextColumn("loss {task.fields[loss]}"), TimeRemainingColumn())
        with Progress(*columns, console=console) as progress:
            task = progress.add_task(adapter, total=steps, loss="-")
            for _ in range(steps):
                batch = rng.sample(datums, min(batch_size, len(datums)))
                backward = training.forward_backward(batch, "cross_entropy")
                training.optim_step(adam)  # queued behind the backward pass, no round trip in between
                losses.append(backward.result().metrics["loss:sum"] / len(batch))
                progress.update(task, advance=1, loss=f"{losses[-1]:.3f}")
        published = training.save_weights_for_sampler("loraplane-train", aliases=["latest-train"]).result()
    except APIError as exc:
        raise _fail(exc) from None
    path = plot or Path(f"{adapter.replace('/', '_')}-loss.png")
    plot_losses({adapter: losses}, path, f"loraplane train: {adapter} ({len(examples)} examples)")
    console.print(f"loss {losses[0]:.3f} -> {losses[-1]:.3f} over {steps} steps; published "
                  f"[bold]{published.path}[/bold] (alias latest-train); plot {path}")
    console.print(f'try: loraplane sample "{examples[0][0][:40]}" --adapter {adapter}')
