"""Progress, metrics and the end-of-run report (rank 0 writes; other ranks stay quiet).

- a progress bar with step, loss, tokens/s, the share of the step spent waiting for data, ETA
  and the latest eval loss (tqdm);
- `metrics.jsonl`: one JSON record per logged step (appended across resumes); a step after which
  the eval set was evaluated carries `eval_loss` (after that step's update) and `eval_targets`;
- `report.json` and `loss_curve.png` (training and eval loss) at the end.
"""

from __future__ import annotations

import json
import statistics
from pathlib import Path


class MetricsLogger:
    def __init__(self, output_dir: str | Path, *, total_steps: int, start_step: int, enabled: bool,
                 monitor=None):
        self.enabled = enabled
        self.path = Path(output_dir) / "metrics.jsonl"
        self.monitor = monitor  # DeepSpeed's monitor (TensorBoard / CSV / W&B) when configured
        self.bar = None
        self.eval_loss = None  # the latest, shown in the progress bar until the next
        if enabled:
            from tqdm.auto import tqdm
            self.bar = tqdm(total=total_steps, initial=start_step, desc="train", unit="step",
                            dynamic_ncols=True)

    def log(self, record: dict) -> None:
        if not self.enabled:
            return
        with self.path.open("a") as f:
            f.write(json.dumps(record) + "\n")
        self.eval_loss = record.get("eval_loss", self.eval_loss)
        evaluated = {} if self.eval_loss is None else {"eval": f"{self.eval_loss:.4f}"}
        waited = ({"data_wait": f"{record['data_wait_s'] / record['step_s']:.0%}"}
                  if "data_wait_s" in record and record.get("step_s") else {})
        self.bar.set_postfix(loss=f"{record['loss']:.4f}", tok_s=f"{record['tokens_per_s']:.0f}",
                             **waited, **evaluated)
        if self.monitor is not None and self.monitor.enabled:
            events = [("Train/loss", record["loss"], record["step"]),
                      ("Train/tokens_per_s", record["tokens_per_s"], record["step"])]
            if "eval_loss" in record:
                events.append(("Eval/loss", record["eval_loss"], record["step"]))
            self.monitor.write_events(events)

    def advance(self) -> None:
        if self.bar is not None:
            self.bar.update(1)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


def read_metrics(output_dir: str | Path) -> list[dict]:
    path = Path(output_dir) / "metrics.jsonl"
    if not path.exists():
        return []
    records = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    by_step = {r["step"]: r for r in records}  # a resumed run may log a step again: keep the last
    return [by_step[s] for s in sorted(by_step)]


def write_report(output_dir: str | Path, extra: dict) -> dict:
    """report.json (first/last loss, median throughput) and loss_curve.png from metrics.jsonl."""
    out = Path(output_dir)
    records = read_metrics(out)
    if not records:
        return {}
    losses = [r["loss"] for r in records]
    evals = [r["eval_loss"] for r in records if "eval_loss" in r]
    head = max(1, len(losses) // 10)
    report = {
        "steps": records[-1]["step"] + 1,
        "first_loss": losses[0],
        "last_loss": losses[-1],
        "first_loss_mean10pct": statistics.fmean(losses[:head]),
        "last_loss_mean10pct": statistics.fmean(losses[-head:]),
        "median_tokens_per_s": statistics.median(r["tokens_per_s"] for r in records),
        "median_step_s": statistics.median(r["step_s"] for r in records),
        **({"last_eval_loss": evals[-1], "best_eval_loss": min(evals)} if evals else {}),
        **extra,
    }
    (out / "report.json").write_text(json.dumps(report, indent=1))
    _plot(records, out / "loss_curve.png")
    return report


def _plot(records: list[dict], path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(6, 3.5))
    ax.plot([r["step"] for r in records], [r["loss"] for r in records], lw=1.2, label="train")
    evals = [r for r in records if "eval_loss" in r]
    if evals:
        ax.plot([r["step"] for r in evals], [r["eval_loss"] for r in evals], "o-", ms=3, lw=1.2,
                label="eval")
        ax.legend()
    ax.set_xlabel("step")
    ax.set_ylabel("loss per target token (log)")
    ax.set_yscale("log")
    ax.set_title("ds_omni training loss")
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
