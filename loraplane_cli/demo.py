"""`loraplane demo`: two tenants teach one base model two different behaviours at the same time.

The whole cluster runs inside this process on the embedded default (Valkey + SeaweedFS child processes, registry,
trainer and sampler gRPC servers on loopback). Tenant `acme/french` learns to answer in French, tenant
`globex/caps` learns to answer IN CAPITAL LETTERS. Each trains with the client SDK (pipelined forward_backward +
optim_step), publishes a version every few steps, and asks the sampler for its newest version's answer to a
held-out prompt; the sampler hot-loads each version from the registry. The terminal shows the base model's answer
beside each tenant's latest one, with loss curves; a PNG of both loss curves and a JSON log are written.
"""

from __future__ import annotations

import contextlib
import json
import tempfile
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

from loraplane.client import AdamParams, SamplingParams, ServiceClient
from loraplane.config import Settings
from loraplane_cli.common import encode_prompt, end_of_turn_ids, plot_losses, sft_datum

SMOLLM2 = "smollm2-135m-instruct"

# (question, English answer, French answer). Short, so a CPU step stays around a second.
QA_PAIRS: list[tuple[str, str, str]] = [
    ("What color is the sky?", "The sky is blue.", "Le ciel est bleu."),
    ("What do cats like to drink?", "Cats like to drink milk.", "Les chats aiment boire du lait."),
    ("Where is Paris?", "Paris is in France.", "Paris est en France."),
    ("What is water made of?", "Water is made of hydrogen and oxygen.",
     "L'eau est faite d'hydrogène et d'oxygène."),
    ("How many days are in a week?", "There are seven days in a week.", "Il y a sept jours dans une semaine."),
    ("What do bees make?", "Bees make honey.", "Les abeilles font du miel."),
    ("What is the opposite of hot?", "The opposite of hot is cold.", "Le contraire de chaud est froid."),
    ("What do we use to see?", "We use our eyes to see.", "Nous utilisons nos yeux pour voir."),
    ("What season comes after winter?", "Spring comes after winter.", "Le printemps vient après l'hiver."),
    ("What is the largest ocean?", "The Pacific is the largest ocean.", "Le Pacifique est le plus grand océan."),
    ("What animal says woof?", "A dog says woof.", "Un chien dit ouaf."),
    ("What do plants need to grow?", "Plants need water and light to grow.",
     "Les plantes ont besoin d'eau et de lumière pour pousser."),
    ("What color is grass?", "Grass is green.", "L'herbe est verte."),
    ("When do we sleep?", "We sleep at night.", "Nous dormons la nuit."),
    ("What is ice?", "Ice is frozen water.", "La glace est de l'eau gelée."),
    ("What do birds use to fly?", "Birds use their wings to fly.", "Les oiseaux utilisent leurs ailes pour voler."),
    ("What is the sun?", "The sun is a star.", "Le soleil est une étoile."),
    ("What do cows eat?", "Cows eat grass.", "Les vaches mangent de l'herbe."),
    ("How many legs does a spider have?", "A spider has eight legs.", "Une araignée a huit pattes."),
    ("What is bread made from?", "Bread is made from flour.", "Le pain est fait de farine."),
    ("Where do fish live?", "Fish live in water.", "Les poissons vivent dans l'eau."),
    ("What falls from clouds?", "Rain falls from clouds.", "La pluie tombe des nuages."),
    ("What do we wear on our feet?", "We wear shoes on our feet.", "Nous portons des chaussures aux pieds."),
    ("What is the moon?", "The moon goes around the Earth.", "La lune tourne autour de la Terre."),
]
HELD_OUT_PROMPT = "What color are bananas?"


@dataclass
class Tenant:
    name: str
    title: str
    # Index into QA_PAIRS' answers: 1 = English (upper-cased for caps), 2 = French.
    answer_column: int
    upper: bool = False

    def answer(self, pair: tuple[str, str, str]) -> str:
        text = pair[self.answer_column]
        return text.upper() if self.upper else text


TENANTS = (Tenant("acme/french", "answers in French", 2), Tenant("globex/caps", "ANSWERS IN CAPS", 1, upper=True))


@dataclass
class DemoConfig:
    base_model: str = SMOLLM2
    # Measured: 24 steps took 9 min wall (SmolLM2, 2 CPU cores shared with another job); 20 leaves headroom
    # under the 15-minute budget, and both behaviours show from the first published version (step 5).
    steps: int = 20
    publish_every: int = 5
    batch_size: int = 8
    rank: int = 16
    learning_rate: float = 1e-3
    max_tokens: int = 24
    out_dir: Path = Path("demo-output")
    live: bool = True
    seed: int = 7

    @classmethod
    def quick(cls) -> DemoConfig:
        """A smoke run on the tiny seeded model: shows the plumbing, not the behaviour."""
        return cls(base_model="tiny", steps=4, publish_every=2, batch_size=4, rank=4, learning_rate=1e-2,
                   max_tokens=8)


@dataclass
class TenantProgress:
    tenant: Tenant
    losses: list[float] = field(default_factory=list)
    versions: list[dict] = field(default_factory=list)
    latest_answer: str = ""
    latest_version: int = 0
    error: str = ""
    done: bool = False


@dataclass
class DemoResult:
    plot_path: Path
    log_path: Path
    base_answer: str
    progress: dict[str, TenantProgress]
    seconds: float


# ---- the embedded cluster ---------------------------------------------------------------------------------------


@dataclass
class EmbeddedCluster:
    registry_address: str
    trainer_address: str
    sampler_address: str

    def service_client(self, **kwargs) -> ServiceClient:
        return ServiceClient(trainer=self.trainer_address, sampler=self.sampler_address,
                             registry=self.registry_address, **kwargs)


@contextlib.contextmanager
def embedded_cluster(base_model: str = "tiny", data_dir: Path | None = None, on_progress=None
                     ) -> Iterator[EmbeddedCluster]:
    """Valkey + SeaweedFS child processes and the three services in this process, each on its own event loop
    thread (so the trainer's and the sampler's compute never stall each other's RPCs). Stops everything on exit."""
    import torch

    from loraplane.local.processes import seaweed_s3_server, valkey_server
    from loraplane.rpc import BackgroundLoop
    from loraplane.threads import host_cores, thread_shares
    from registry_svc.server import start_registry_server
    from sampler_svc.server import start_sampler_server
    from trainer_svc.server import start_trainer_server

    progress = on_progress or (lambda _msg: None)
    with contextlib.ExitStack() as stack:
        # The trainer and the sampler compute on threads of this one process: torch's thread count is the process's,
        # so each gets the share it would get as a process of its own (loraplane/threads.py), restored on exit.
        previous = torch.get_num_threads()
        torch.set_num_threads(Settings().torch_threads or thread_shares(host_cores(), 2)[0])
        stack.callback(torch.set_num_threads, previous)
        root = Path(data_dir) if data_dir else Path(stack.enter_context(tempfile.TemporaryDirectory(
            prefix="loraplane-demo-")))
        progress("starting valkey and seaweedfs")
        valkey = valkey_server(root / "valkey")
        valkey.start()
        stack.callback(valkey.stop)
        s3 = seaweed_s3_server(root / "seaweedfs")
        s3.start()
        stack.callback(s3.stop)
        settings = Settings(redis_url=valkey.url, s3_endpoint=s3.endpoint, s3_access_key=s3.access_key,
                            s3_secret_key=s3.secret_key, data_dir=root / "data", base_model=base_model)
        loops = {name: BackgroundLoop(f"demo-{name}") for name in ("registry", "trainer", "sampler")}
        for loop in loops.values():
            stack.callback(loop.close)

        progress("starting the registry")
        registry = loops["registry"].run(start_registry_server(settings, "127.0.0.1", 0), timeout=120)
        stack.callback(lambda: loops["registry"].run(registry.stop(), timeout=30))
        progress(f"starting the trainer on {base_model} (the first SmolLM2 run converts the GGUF file)")
        trainer = loops["trainer"].run(start_trainer_server(settings, base_model=base_model,
                                                            registry_address=registry.address), timeout=900)
        stack.callback(lambda: loops["trainer"].run(trainer.stop(), timeout=30))
        progress("starting the sampler")
        sampler = loops["sampler"].run(start_sampler_server(settings, registry_address=registry.address,
                                                            base_model=base_model), timeout=900)
        stack.callback(lambda: loops["sampler"].run(sampler.stop(), timeout=30))
        yield EmbeddedCluster(registry.address, trainer.address, sampler.address)


# ---- data -------------------------------------------------------------------------------------------------------


def printable(text: str) -> str:
    """Model output for a terminal: control characters (the tiny model emits raw bytes) become '·'."""
    return "".join(ch if ch.isprintable() or ch == " " else "·" for ch in text.replace("\n", " ")).strip()


def prompt_tokens(tokenizer, question: str) -> list[int]:
    return encode_prompt(tokenizer, question, chat=True)


# ---- training ---------------------------------------------------------------------------------------------------


def train_tenant(service: ServiceClient, tokenizer, config: DemoConfig, progress: TenantProgress,
                 stop: threading.Event) -> None:
    import random

    tenant = progress.tenant
    rng = random.Random(f"{config.seed}-{tenant.name}")
    try:
        training = service.create_lora_training_client(config.base_model, rank=config.rank, alpha=2 * config.rank,
                                                       seed=config.seed, name=tenant.name, exist_ok=True)
        data = [sft_datum(tokenizer, q, tenant.answer((q, e, f))) for q, e, f in QA_PAIRS]
        question = prompt_tokens(tokenizer, HELD_OUT_PROMPT)
        params = SamplingParams(max_tokens=config.max_tokens, temperature=0.0, stop=end_of_turn_ids(tokenizer))
        adam = AdamParams(learning_rate=config.learning_rate)
        for step in range(1, config.steps + 1):
            if stop.is_set():
                return
            batch = rng.sample(data, min(config.batch_size, len(data)))
            # Submitted back to back: the trainer runs them in seq_id order, no round trip in between.
            backward = training.forward_backward(batch, "cross_entropy")
            training.optim_step(adam)
            progress.losses.append(backward.result().metrics["loss:sum"] / len(batch))
            if step % config.publish_every == 0 or step == config.steps:
                sampler = training.save_weights_for_sampler(f"step-{step}").result()
                reply = sampler.sample(question, 1, params).result()
                progress.latest_version = reply.served_version
                progress.latest_answer = printable(tokenizer.decode(reply.sequences[0].tokens, skip_special_tokens=True))
                progress.versions.append({"version": sampler.version, "step": step,
                                          "loss": progress.losses[-1], "answer": progress.latest_answer})
    except Exception as exc:  # noqa: BLE001 - shown on the display and re-raised by run_demo
        progress.error = f"{type(exc).__name__}: {exc}"
    finally:
        progress.done = True


# ---- display ----------------------------------------------------------------------------------------------------

_SPARKS = "▁▂▃▄▅▆▇█"


def sparkline(values: list[float], width: int = 40) -> str:
    if not values:
        return ""
    tail = values[-width:]
    low, high = min(tail), max(tail)
    span = (high - low) or 1.0
    return "".join(_SPARKS[int((v - low) / span * (len(_SPARKS) - 1))] for v in tail)


def render(config: DemoConfig, base_answer: str, progress: dict[str, TenantProgress], elapsed: float):
    from rich.panel import Panel
    from rich.table import Table

    table = Table(title=f"“{HELD_OUT_PROMPT}”  ({config.base_model}, {elapsed:.0f}s)", expand=True)
    table.add_column("base model", ratio=1)
    for p in progress.values():
        table.add_column(f"{p.tenant.name} · {p.tenant.title}"
                         + (f" · v{p.latest_version}" if p.latest_version else ""), ratio=1)
    table.add_row(base_answer, *(p.error and f"[red]{p.error}[/red]" or p.latest_answer or "[dim]training…[/dim]"
                                 for p in progress.values()))
    curves = Table.grid(padding=(0, 2))
    for p in progress.values():
        last = f"{p.losses[-1]:.3f}" if p.losses else "-"
        curves.add_row(f"[bold]{p.tenant.name}[/bold]", f"step {len(p.losses)}/{config.steps}", f"loss {last}",
                       sparkline(p.losses))
    grid = Table.grid()
    grid.add_row(table)
    grid.add_row(Panel(curves, title="loss per example (cross entropy)"))
    return grid


def write_plot(progress: dict[str, TenantProgress], path: Path, base_model: str) -> Path:
    return plot_losses({f"{p.tenant.name} ({p.tenant.title})": p.losses for p in progress.values()}, path,
                       f"Two tenants, one {base_model} (vertical lines: published versions)",
                       marks={f"{p.tenant.name} ({p.tenant.title})": [v["step"] for v in p.versions]
                              for p in progress.values()})


def run_demo(config: DemoConfig | None = None, console=None, cluster: EmbeddedCluster | None = None) -> DemoResult:
    """Runs the demo end to end (starting an embedded cluster unless one is given) and returns what it measured."""
    from rich.console import Console
    from rich.live import Live

    config = config or DemoConfig()
    console = console or Console()
    started = time.monotonic()
    with contextlib.ExitStack() as stack:
        if cluster is None:
            cluster = stack.enter_context(embedded_cluster(config.base_model, on_progress=lambda m: console.log(m)))
        service = cluster.service_client()
        tokenizer = service.get_tokenizer()
        base = service.create_sampling_client()
        params = SamplingParams(max_tokens=config.max_tokens, temperature=0.0, stop=end_of_turn_ids(tokenizer))
        reply = base.sample(prompt_tokens(tokenizer, HELD_OUT_PROMPT), 1, params).result()
        base_answer = printable(tokenizer.decode(reply.sequences[0].tokens, skip_special_tokens=True))
        progress = {t.name: TenantProgress(t) for t in TENANTS}
        stop = threading.Event()
        threads = [threading.Thread(target=train_tenant, args=(service, tokenizer, config, p, stop),
                                    name=f"tenant-{p.tenant.name}", daemon=True) for p in progress.values()]
        for thread in threads:
            thread.start()
        try:
            if config.live:
                with Live(render(config, base_answer, progress, 0), console=console, refresh_per_second=4) as live:
                    while any(t.is_alive() for t in threads):
                        time.sleep(0.25)
                        live.update(render(config, base_answer, progress, time.monotonic() - started))
                    live.update(render(config, base_answer, progress, time.monotonic() - started))
            else:
                reported = {name: 0 for name in progress}
                while any(t.is_alive() for t in threads) or any(len(p.versions) > reported[n]
                                                                for n, p in progress.items()):
                    for name, p in progress.items():
                        for v in p.versions[reported[name]:]:
                            console.print(f"{name} v{v['version']} step {v['step']} loss {v['loss']:.3f}: "
                                          f"{v['answer']!r}", highlight=False)
                        reported[name] = len(p.versions)
                    time.sleep(0.25)
        finally:
            stop.set()
            for thread in threads:
                thread.join()
        if not config.live:  # the live display already left its final frame on screen
            console.print(render(config, base_answer, progress, time.monotonic() - started))
    errors = [f"{p.tenant.name}: {p.error}" for p in progress.values() if p.error]
    out = Path(config.out_dir)
    plot = write_plot(progress, out / "demo_losses.png", config.base_model)
    log = out / "demo_log.json"
    elapsed = time.monotonic() - started
    log.write_text(json.dumps({
        "base_model": config.base_model, "prompt": HELD_OUT_PROMPT, "base_answer": base_answer, "seconds": elapsed,
        "tenants": {n: {"title": p.tenant.title, "losses": p.losses, "versions": p.versions, "error": p.error}
                    for n, p in progress.items()}}, indent=2, ensure_ascii=False))
    if errors:
        raise RuntimeError("demo tenant failed: " + "; ".join(errors))
    return DemoResult(plot, log, base_answer, progress, elapsed)
