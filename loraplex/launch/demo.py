"""`loraplex demo`: four tenants train four different small tasks at the same time through the Python client against
the embedded stack; each tenant's loss must fall clearly."""

from __future__ import annotations

import json
import threading
import zlib
from dataclasses import asdict, dataclass
from pathlib import Path

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from loraplex.client import AdamParams, Datum, ServiceClient

# Each tenant memorises its own small corpus; the tasks differ so a leak between adapters would show.
TASKS: dict[str, list[str]] = {
    "counting": ["one two three four five six", "two three four five six seven", "three four five six seven eight",
                 "four five six seven eight nine"],
    "alphabet": ["a b c d e f g h", "b c d e f g h i", "c d e f g h i j", "d e f g h i j k"],
    "greetings": ["hello world, how are you", "good morning, dear friend", "see you later, my friend",
                  "hello again, good night"],
    "arithmetic": ["2+3=5 and 4+4=8", "1+1=2 and 3+3=6", "5+2=7 and 6+1=7", "9+0=9 and 0+8=8"],
}  # fmt: skip


@dataclass
class TenantReport:
    name: str
    model_id: str
    steps: int
    first_loss: float
    last_loss: float


def load_tokenizer(settings_cache: Path, base_model: str):
    from transformers import PreTrainedTokenizerFast

    from loraplex.models import resolve

    return PreTrainedTokenizerFast.from_pretrained(str(resolve(base_model, settings_cache)))


def train_tenant(
    client: ServiceClient, name: str, texts: list[str], tokenizer, steps: int, lr: float, rank: int, on_step
) -> TenantReport:
    trainer = client.create_lora_training_client(rank=rank, seed=zlib.crc32(name.encode()) % 10_000)
    data = [Datum.for_next_token(tokenizer.encode(t)) for t in texts]
    n_targets = sum(len(d.model_input) for d in data)
    losses: list[float] = []
    for step in range(steps):
        fb = trainer.forward_backward(data, "cross_entropy")
        opt = trainer.optim_step(AdamParams(learning_rate=lr))
        loss = fb.result()["metrics"]["loss:sum"] / n_targets  # per target token, to compare tasks
        opt.result()
        losses.append(loss)
        on_step(step, loss)
    return TenantReport(name, trainer.model_id, steps, losses[0], losses[-1])


def run_demo(base_url: str, keys: dict[str, str], tokenizer, *, steps: int, lr: float, rank: int, console: Console):
    reports: dict[str, TenantReport] = {}
    errors: list[BaseException] = []
    with Progress(
        TextColumn("{task.description:<12}"), BarColumn(), MofNCompleteColumn(), TextColumn("loss {task.fields[loss]}"),
        TimeElapsedColumn(), console=console,
    ) as progress:  # fmt: skip
        bars = {name: progress.add_task(name, total=steps, loss="-") for name in keys}

        def worker(name: str) -> None:
            try:
                with ServiceClient(base_url, keys[name]) as client:
                    reports[name] = train_tenant(
                        client, name, TASKS[name], tokenizer, steps, lr, rank,
                        lambda _s, loss: progress.update(bars[name], advance=1, loss=f"{loss:.3f}"),
                    )  # fmt: skip
            except BaseException as exc:  # reported after all threads finish
                errors.append(exc)

        threads = [threading.Thread(target=worker, args=(name,)) for name in keys]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    if errors:
        raise errors[0]
    return [reports[name] for name in keys]


def print_table(reports: list[TenantReport], console: Console) -> None:
    table = Table(title="loraplex demo: loss per target token")
    for col in ("tenant", "adapter", "steps", "first loss", "last loss", "last/first"):
        table.add_column(col)
    for r in reports:
        table.add_row(r.name, r.model_id[:12], str(r.steps), f"{r.first_loss:.3f}", f"{r.last_loss:.3f}",
                      f"{r.last_loss / r.first_loss:.2f}")  # fmt: skip
    console.print(table)


def write_report(reports: list[TenantReport], path: Path) -> None:
    path.write_text(json.dumps({"tenants": [asdict(r) for r in reports]}, indent=2))
