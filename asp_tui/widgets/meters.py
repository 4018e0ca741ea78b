"""Queue, lag, trainer and scheduler meters: numbers in words plus sparklines."""

from __future__ import annotations

from collections.abc import Sequence

from textual.app import ComposeResult
from textual.containers import Horizontal, Vertical
from textual.content import Content
from textual.widgets import Sparkline, Static

from asp_tui.format import gauge, ratio_text, rho_text
from runtime.protocol import Snapshot


def _set_data(spark: Sparkline, values: Sequence[float]) -> None:
    """Assign a *new* list: Sparkline.data is a reactive compared with ``!=``."""
    data = list(values)
    if spark.data != data:
        spark.data = data


def histogram_text(histogram: Sequence[int], bound: int, width: int) -> str:
    """Consumed-lag histogram ``0▇ 1▃ 2▁``: one bar per lag value, scaled to the tallest."""
    bars = " ▁▂▃▄▅▆▇█"
    counts = list(histogram) or [0]
    tallest = max(counts) or 1
    cells = []
    for lag, count in enumerate(counts[: max(bound + 2, 1)]):
        # Any nonzero count gets at least the lowest bar, so "rare" never reads as "none".
        bar = bars[max(1, round(count / tallest * 8))] if count else "·"
        cells.append(f"{lag}{bar}")
    return " ".join(cells)[:width]


class Resizable:
    """Bars are sized to the panel: redraw the last data when the panel's size changes."""

    _last: tuple | None = None

    def on_resize(self) -> None:
        if self._last is not None:
            self.show(*self._last)  # type: ignore[attr-defined]


class QueueMeter(Resizable, Vertical):
    """Training-queue depth against capacity, plus a sparkline of its history."""

    def __init__(self, *, id: str | None = None, classes: str | None = None) -> None:
        super().__init__(id=id, classes=classes)
        self.text = Static("", classes="meter-text")
        self.spark = Sparkline([], classes="meter-spark")

    def compose(self) -> ComposeResult:
        yield self.text
        yield self.spark

    def on_mount(self) -> None:
        self.border_title = "Queue"

    def show(self, snapshot: Snapshot, history: Sequence[float]) -> None:
        self._last = (snapshot, history)
        width = max(self.content_size.width, 10)
        capacity = snapshot.queue_capacity
        text = Content.assemble(
            (f"{snapshot.queue_depth}", "bold"),
            f"/{capacity} groups  in-flight {snapshot.in_flight_groups}\n",
            (gauge(snapshot.queue_depth, capacity, width), "$accent"),
        )
        self.text.update(text, layout=False)  # fixed height: no relayout per tick
        _set_data(self.spark, history)


class LagMeter(Resizable, Vertical):
    """Policy lag mean/p95/max against the bound as a gauge, plus the consumed-lag histogram."""

    def __init__(self, *, id: str | None = None, classes: str | None = None) -> None:
        super().__init__(id=id, classes=classes)
        self.text = Static("", classes="meter-text")

    def compose(self) -> ComposeResult:
        yield self.text

    def on_mount(self) -> None:
        self.border_title = "Policy lag"

    def show(self, snapshot: Snapshot) -> None:
        self._last = (snapshot,)
        width = max(self.content_size.width, 10)
        lag = snapshot.lag
        bound = snapshot.lag_bound
        over = lag.max > bound
        pending = ""
        if snapshot.pending_lag_bound is not None and snapshot.pending_lag_bound != bound:
            pending = f" → {snapshot.pending_lag_bound}"
        gauge_width = max(width - 9, 4)
        text = Content.assemble(
            f"mean {lag.mean:.2f} p95 {lag.p95:.2f} ",
            (f"max {lag.max}", "bold $error" if over else "bold"),
            "\n",
            (gauge(lag.max, max(bound, 1), gauge_width), "$error" if over else "$success"),
            (f" η={bound}{pending}", "bold"),
            "\n",
            ("lags ", "$text-muted"),
            histogram_text(lag.histogram, bound, width - 5),
        )
        self.text.update(text, layout=False)  # fixed height: no relayout per tick


class TrainerMeter(Vertical):
    """Reward, loss, iteration time and samples/s, each with a sparkline over trainer steps."""

    ROWS = (
        ("reward", "reward {:.3f}"),
        ("loss", "loss {:.4f}"),
        ("iteration", "iter {:.2f}s"),
        ("samples", "{:.1f} samp/s"),
    )

    def __init__(self, *, id: str | None = None, classes: str | None = None) -> None:
        super().__init__(id=id, classes=classes)
        self.texts = {key: Static("", classes="trainer-text") for key, _ in self.ROWS}
        self.sparks = {key: Sparkline([], classes="trainer-spark") for key, _ in self.ROWS}

    def compose(self) -> ComposeResult:
        for key, _ in self.ROWS:
            with Horizontal(classes="trainer-row"):
                yield self.texts[key]
                yield self.sparks[key]

    def on_mount(self) -> None:
        self.border_title = "Trainer"

    def show(self, snapshot: Snapshot, series: dict[str, Sequence[float]]) -> None:
        trainer = snapshot.trainer
        values = {
            "reward": trainer.reward_mean,
            "loss": trainer.loss,
            "iteration": trainer.iteration_s,
            "samples": trainer.samples_per_s,
        }
        self.border_title = f"Trainer ({trainer.state})"
        if trainer.train_s:
            # Where the last step's wall time went: is the trainer starved, busy or syncing?
            self.border_subtitle = (
                f"wait {trainer.wait_batch_s:.2f} train {trainer.train_s:.2f} "
                f"sync {trainer.sync_s:.2f}s"
            )
        for key, template in self.ROWS:
            self.texts[key].update(template.format(values[key]), layout=False)
            _set_data(self.sparks[key], series[key])


class SchedulerMeter(Vertical):
    """What the scheduler did about stragglers, in the last step and in the run (groups
    deferred, groups migrated), and how well its length predictor ranked and scaled the last
    batch's longest samples (Spearman ρ, median actual/predicted), with ρ per step.

    Wide: three lines in a panel. Compact: one line, no border (the predictor's sparkline
    hidden), so an 80×24 terminal gives up one table row for it."""

    def __init__(self, *, id: str | None = None, classes: str | None = None) -> None:
        super().__init__(id=id, classes=classes)
        self.text = Static("", classes="meter-text")
        self.predictor = Static("", classes="sched-predictor")
        self.spark = Sparkline([], classes="sched-spark")

    def compose(self) -> ComposeResult:
        yield self.text
        with Horizontal(classes="sched-row"):
            yield self.predictor
            yield self.spark

    def on_mount(self) -> None:
        self.border_title = "Scheduler"

    def show(self, snapshot: Snapshot, rho_history: Sequence[float], wide: bool) -> None:
        trainer = snapshot.trainer
        rho = rho_text(trainer.predictor_longest_rho)
        ratio = ratio_text(trainer.predictor_longest_ratio)
        if wide:
            width = len(str(max(trainer.deferred, snapshot.deferred_groups)))
            text = Content.assemble(
                ("step ", "bold"),
                f" deferred {trainer.deferred:<{width}}  migrated {trainer.migrated}\n",
                ("run  ", "bold"),
                f" deferred {snapshot.deferred_groups:<{width}}  migrated "
                f"{snapshot.migrated_groups}",
            )
            self.predictor.update(
                Content.assemble(("predictor ", "bold"), f"ρ {rho}  actual/predicted {ratio} "),
                layout=False,
            )
            _set_data(self.spark, rho_history)
        else:
            text = Content.assemble(
                ("step ", "bold"),
                f"deferred {trainer.deferred} (run {snapshot.deferred_groups})  "
                f"migrated {trainer.migrated} (run {snapshot.migrated_groups})  ",
                ("predictor ", "bold"),
                f"ρ {rho} {ratio}",
            )
        self.text.update(text, layout=False)  # fixed height: no relayout per tick
