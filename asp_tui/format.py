"""Plain-text formatting shared by the dashboard and ``asp-tui attach --once``.

No Textual here: the words, glyphs and numbers an operator reads are decided once, so the
``--once`` text and the live table never disagree about what a state is called.
"""

from __future__ import annotations

import time

from runtime.protocol import BUBBLE_CATEGORIES, InstanceSnapshot, Lane, Snapshot

STATE_GLYPHS = {
    "running": "▶",
    "paused": "⏸",
    "syncing": "⟳",
    "down": "✖",
    "starting": "◌",
}
"""One glyph per instance state, so state never depends on colour alone."""

PENDING_GLYPH = "…"

BUBBLE_GLYPHS = {
    "useful": "█",
    "padding": "▓",
    "skewness": "▒",
    "sorting": "░",
    "sync": "≈",
    "paused": "‖",
    "down": "×",
    "idle": "·",
}
"""Each bubble category fills its part of the bar with its own character (colour is extra)."""

BUBBLE_WORDS = {
    "padding": "padding (uneven lengths)",
    "skewness": "skewness (long tails)",
    "sorting": "sorting (queue starved or full)",
    "sync": "weight sync",
    "paused": "operator pause",
    "down": "instances down",
    "idle": "idle (start-up or no work)",
}
"""The top cause of lost capacity, in words."""


def state_word(state: str) -> str:
    """``paused`` -> ``PAUSED``; an unknown state is shown as itself, upper-cased."""
    return state.upper() if state else "UNKNOWN"


def state_label(state: str, pending: str = "") -> str:
    """Glyph and word for the table, e.g. ``⏸ PAUSED`` or ``… PAUSING`` while pending."""
    if pending:
        return f"{PENDING_GLYPH} {pending.upper()}"
    return f"{STATE_GLYPHS.get(state, '?')} {state_word(state)}"


def gauge(value: float, total: float, width: int) -> str:
    """A fixed-width bar: ``value/total`` of ``width`` cells filled (eighths for the edge)."""
    if width <= 0:
        return ""
    fraction = 0.0 if total <= 0 else min(max(value / total, 0.0), 1.0)
    eighths = round(fraction * width * 8)
    full, part = divmod(eighths, 8)
    partial = " ▏▎▍▌▋▊▉"[part] if part and full < width else ""
    return ("█" * full + partial).ljust(width, "·")


def normalised(bubbles: dict[str, float]) -> dict[str, float]:
    """Fractions in category order that sum to 1 (or all zero when nothing was measured)."""
    values = {name: max(float(bubbles.get(name, 0.0)), 0.0) for name in BUBBLE_CATEGORIES}
    total = sum(values.values())
    if total <= 0:
        return dict.fromkeys(BUBBLE_CATEGORIES, 0.0)
    return {name: value / total for name, value in values.items()}


def bar_segments(bubbles: dict[str, float], width: int) -> list[tuple[str, int]]:
    """Split ``width`` cells between the categories by largest remainder, so they sum exactly."""
    fractions = normalised(bubbles)
    if width <= 0 or not any(fractions.values()):
        return []
    raw = {name: fractions[name] * width for name in BUBBLE_CATEGORIES}
    cells = {name: int(value) for name, value in raw.items()}
    left = width - sum(cells.values())
    for name in sorted(BUBBLE_CATEGORIES, key=lambda n: raw[n] - cells[n], reverse=True)[:left]:
        cells[name] += 1
    return [(name, cells[name]) for name in BUBBLE_CATEGORIES if cells[name]]


def bubble_bar(bubbles: dict[str, float], width: int) -> str:
    """The stacked bar as plain characters (one glyph per category)."""
    text = "".join(BUBBLE_GLYPHS[name] * cells for name, cells in bar_segments(bubbles, width))
    return text.ljust(width, " ")


def top_cause(bubbles: dict[str, float]) -> tuple[str, float] | None:
    """The largest non-useful category and its share, or None when nothing is lost."""
    fractions = normalised(bubbles)
    lost = [(name, share) for name, share in fractions.items() if name != "useful" and share > 0]
    if not lost:
        return None
    return max(lost, key=lambda item: item[1])


def top_cause_words(bubbles: dict[str, float], short: bool = False) -> str:
    """``top loss: padding (uneven lengths) 18%``, or a note that nothing is lost."""
    cause = top_cause(bubbles)
    if cause is None:
        return "no capacity lost" if any(bubbles.values()) else "not measured yet"
    name, share = cause
    words = name if short else BUBBLE_WORDS.get(name, name)
    return f"top loss: {words} {share:.0%}"


def rho_text(rho: float | None) -> str:
    """The predictor's rank correlation, or ``–`` when the step had none to rank."""
    return "–" if rho is None else f"{rho:.2f}"


def ratio_text(ratio: float | None) -> str:
    """Median actual/predicted as a factor (``×1.08``: 8% longer than predicted)."""
    return "–" if ratio is None else f"×{ratio:.2f}"


def percent(value: float) -> str:
    return f"{value * 100:.0f}%"


def clock_time(timestamp: float) -> str:
    """``HH:MM:SS`` in UTC, so logs read the same on every host (and in snapshot tests)."""
    return time.strftime("%H:%M:%S", time.gmtime(timestamp))


def age_words(seconds: float) -> str:
    """``3s``, ``2m05s``, ``1h04m``: the age of the last data."""
    seconds = max(int(seconds), 0)
    if seconds < 60:
        return f"{seconds}s"
    if seconds < 3600:
        return f"{seconds // 60}m{seconds % 60:02d}s"
    return f"{seconds // 3600}h{seconds % 3600 // 60:02d}m"


def lag_line(snapshot: Snapshot) -> str:
    lag = snapshot.lag
    pending = ""
    if snapshot.pending_lag_bound is not None and snapshot.pending_lag_bound != snapshot.lag_bound:
        pending = (
            f" (→ {snapshot.pending_lag_bound} pending, on decrease: {snapshot.on_lag_decrease})"
        )
    return (
        f"mean {lag.mean:.2f}  p95 {lag.p95:.2f}  max {lag.max}  (bound η={snapshot.lag_bound}"
        f"{pending})"
    )


def instance_line(instance: InstanceSnapshot) -> str:
    return (
        f"instance {instance.instance_id:>3}  {state_word(instance.state):<8}  "
        f"in-flight {instance.in_flight_groups:>3} groups / {instance.running_seqs:>3} seqs  "
        f"{instance.tokens_per_s:>8.0f} tok/s  v{instance.weight_version} "
        f"(behind {instance.versions_behind})  bubble {percent(instance.bubble_share)}"
        + (f"  {instance.lane} lane" if instance.lane != Lane.BULK else "")
        + (f"  [{instance.pending}]" if instance.pending else "")
    )


def once_text(snapshot: Snapshot, endpoint: str = "") -> str:
    """The ``--once`` report: everything an operator would glance at, in plain words."""
    lines = [
        f"run       {snapshot.run_name}  ({snapshot.state})"
        + (f"  at {endpoint}" if endpoint else ""),
        f"step      {snapshot.step}/{snapshot.total_steps}  "
        f"weight version {snapshot.weight_version}",
        f"queue     {snapshot.queue_depth}/{snapshot.queue_capacity} groups  "
        f"in-flight {snapshot.in_flight_groups}  consumed {snapshot.consumed_groups}  "
        f"discarded {snapshot.discarded_groups}  requeued {snapshot.requeued_groups}",
        f"lag       {lag_line(snapshot)}",
        f"trainer   {snapshot.trainer.state}  reward {snapshot.trainer.reward_mean:.3f}  "
        f"loss {snapshot.trainer.loss:.4f}  iteration {snapshot.trainer.iteration_s:.2f}s  "
        f"{snapshot.trainer.samples_per_s:.1f} samples/s",
        f"step path wait for batch {snapshot.trainer.wait_batch_s:.2f}s  "
        f"train {snapshot.trainer.train_s:.2f}s  weight sync {snapshot.trainer.sync_s:.2f}s",
        f"scheduler deferred {snapshot.deferred_groups}  migrated {snapshot.migrated_groups}  "
        f"(last step {snapshot.trainer.deferred}, {snapshot.trainer.migrated})  "
        f"predictor on the last batch: longest ρ {rho_text(snapshot.trainer.predictor_longest_rho)}"
        f"  actual/predicted {ratio_text(snapshot.trainer.predictor_longest_ratio)}",
    ]
    for title, bubbles in (("window", snapshot.bubbles_window), ("run", snapshot.bubbles_total)):
        shares = normalised(bubbles)
        parts = "  ".join(f"{name} {percent(shares[name])}" for name in BUBBLE_CATEGORIES)
        lines.append(f"bubbles   {title:<6} {parts}")
        lines.append(f"          {title:<6} {top_cause_words(bubbles)}")
    counts = {state: 0 for state in STATE_GLYPHS}
    for instance in snapshot.instances:
        counts[instance.state] = counts.get(instance.state, 0) + 1
    summary = ", ".join(f"{count} {state_word(state)}" for state, count in counts.items() if count)
    lines.append(f"instances {len(snapshot.instances)}" + (f" ({summary})" if summary else ""))
    lines.extend(instance_line(instance) for instance in snapshot.instances)
    if snapshot.auth_refused:
        refused = ", ".join(f"{n} on {s}" for s, n in sorted(snapshot.auth_refused.items()))
        lines.append(
            f"refused   {refused} (clients without an authorized key, or commands "
            "their role may not send)"
        )
    return "\n".join(lines)
