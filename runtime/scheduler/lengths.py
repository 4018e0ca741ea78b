"""Length sources: a lengths file, a per-prompt running history, a prompt-length proxy, and the
predictor-quality report (Spearman rho and MAPE against what actually came).

A lengths file is a CSV, detected from its header:

- *long*: a ``prompt_id`` and an ``output_tokens`` column, one row per sample; rows sharing a
  ``prompt_id`` form a group (an optional ``prompt_tokens`` column is kept);
- *wide*: one row per group and one column per sample, named ``o1..oK`` or ``out_*`` (the grouped
  traces in shared/data/lengths as they are). The group id is the ``prompt_id`` column when the
  file has one (a repeated id is an error), else the data row number counted from 0 (castillo has
  no ``prompt_id``; its ``prompt_idx`` repeats across models).

Prompt ids are text, kept exactly as the file spells them (``h7-0``, ``12``, ``007``): a plan or
output written from the table gives them back unchanged, and a live run matches them against the
task's ids as text (:func:`match_task_ids`). Inside, the schedulers and the controller core
number prompts with dense integers: ``LengthTable.prompt_ids`` is ``0..len-1`` in file order
and ``LengthTable.ids[k]`` is the file's id of prompt ``k``.
"""

from __future__ import annotations

import csv
import math
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from runtime.scheduler.base import GroupSpec

_WIDE = re.compile(r"^(o\d+|out_.+)$")


class LengthsFileError(ValueError):
    """A lengths file that cannot be read; the message names the file, line, column and value."""


@dataclass
class LengthTable:
    """Groups read from a lengths file, in file order: ``ids[k]`` is the file's id of the group
    the schedulers know as prompt ``k``."""

    ids: list[str]
    lengths: list[tuple[int, ...]]
    prompt_tokens: list[int] = field(default_factory=list)
    source: str = ""
    form: str = "long"
    lines: list[int] = field(default_factory=list)
    """The file line each group starts on (empty for a table not read from a file)."""

    def __len__(self) -> int:
        return len(self.ids)

    @property
    def prompt_ids(self) -> list[int]:
        """The dense integer ids the schedulers use: ``0..len-1`` in file order."""
        return list(range(len(self.ids)))

    def as_map(self) -> dict[int, tuple[int, ...]]:
        """Lengths by dense prompt id."""
        return dict(enumerate(self.lengths))

    def by_id(self) -> dict[str, tuple[int, ...]]:
        """Lengths by the file's own id."""
        return dict(zip(self.ids, self.lengths, strict=True))

    def subset(self, ids: Sequence[str], source: str = "") -> LengthTable:
        """The groups with the file ids ``ids``, in that order (every id must be present)."""
        index = {x: k for k, x in enumerate(self.ids)}
        return LengthTable(
            list(ids),
            [self.lengths[index[x]] for x in ids],
            [self.prompt_tokens[index[x]] for x in ids] if self.prompt_tokens else [],
            source or self.source,
            self.form,
            [self.lines[index[x]] for x in ids] if self.lines else [],
        )

    def split(self, predict: int = 1) -> tuple[LengthTable, LengthTable]:
        """(prediction, actual): the first ``predict`` samples of every group predict the rest.
        Groups with too few samples are an error."""
        short = [k for k, ls in enumerate(self.lengths) if len(ls) <= predict]
        if short:
            raise LengthsFileError(
                f"{self.source}: prompt_id {self.ids[short[0]]!r} has "
                f"{len(self.lengths[short[0]])} samples; splitting off {predict} as the "
                "prediction needs more"
            )
        pred = LengthTable(
            self.ids,
            [ls[:predict] for ls in self.lengths],
            self.prompt_tokens,
            self.source,
            self.form,
            self.lines,
        )
        act = LengthTable(
            self.ids,
            [ls[predict:] for ls in self.lengths],
            self.prompt_tokens,
            self.source,
            self.form,
            self.lines,
        )
        return pred, act


def _int(value: str, where: str, column: str) -> int:
    try:
        f = float(value)
    except ValueError:
        raise LengthsFileError(f"{where}: column {column!r}: {value!r} is not an integer") from None
    if not math.isfinite(f) or f != int(f):
        raise LengthsFileError(f"{where}: column {column!r}: {value!r} is not an integer")
    if f < 0:
        raise LengthsFileError(f"{where}: column {column!r}: {value!r} is negative")
    return int(f)


def _id(value: str, where: str) -> str:
    """A prompt id as the file spells it (surrounding blanks dropped); empty is an error."""
    text = value.strip()
    if not text:
        raise LengthsFileError(f"{where}: column 'prompt_id' is empty (every row needs an id)")
    return text


def read_lengths(path: str | Path) -> LengthTable:
    """Read a long or wide lengths CSV (see the module docstring)."""
    p = Path(path)
    if not p.is_file():
        raise LengthsFileError(f"{p}: no such file")
    with p.open(newline="") as fh:
        reader = csv.reader(fh)
        header = next(reader, None)
        if not header:
            raise LengthsFileError(f"{p}: empty file (a header row is required)")
        header = [h.strip() for h in header]
        wide = [j for j, h in enumerate(header) if _WIDE.match(h)]
        col = {h: j for j, h in enumerate(header)}
        tokens_j = col.get("prompt_tokens")
        ids: list[str] = []
        lengths: list[tuple[int, ...]] = []
        ptoks: list[int] = []
        lines: list[int] = []
        if wide:
            id_j = col.get("prompt_id")
            seen: dict[str, int] = {}
            for ln, row in enumerate(reader, start=2):
                if not row:
                    continue
                where = f"{p}:{ln}"
                if len(row) != len(header):
                    raise LengthsFileError(f"{where}: {len(row)} fields, header has {len(header)}")
                lengths.append(tuple(_int(row[j], where, header[j]) for j in wide))
                pid = _id(row[id_j], where) if id_j is not None else str(len(ids))
                if pid in seen:
                    raise LengthsFileError(
                        f"{where}: column 'prompt_id': {pid!r} repeats line {seen[pid]} (a wide "
                        "file has one row per group; rows sharing an id belong in a long file)"
                    )
                seen[pid] = ln
                ids.append(pid)
                lines.append(ln)
                if tokens_j is not None:
                    ptoks.append(_int(row[tokens_j], where, "prompt_tokens"))
            form = "wide"
        else:
            for need in ("prompt_id", "output_tokens"):
                if need not in col:
                    raise LengthsFileError(
                        f"{p}: missing column {need!r} (a long file needs prompt_id and "
                        f"output_tokens; a wide file needs o1..oK or out_* columns); "
                        f"header is {','.join(header)}"
                    )
            groups: dict[str, list[int]] = {}
            toks: dict[str, int] = {}
            for ln, row in enumerate(reader, start=2):
                if not row:
                    continue
                where = f"{p}:{ln}"
                if len(row) != len(header):
                    raise LengthsFileError(f"{where}: {len(row)} fields, header has {len(header)}")
                pid = _id(row[col["prompt_id"]], where)
                if pid not in groups:
                    lines.append(ln)
                groups.setdefault(pid, []).append(
                    _int(row[col["output_tokens"]], where, "output_tokens")
                )
                if tokens_j is not None:
                    toks[pid] = _int(row[tokens_j], where, "prompt_tokens")
            ids = list(groups)
            lengths = [tuple(groups[i]) for i in ids]
            ptoks = [toks[i] for i in ids] if tokens_j is not None else []
            form = "long"
    if not ids:
        raise LengthsFileError(f"{p}: no data rows")
    return LengthTable(ids, lengths, ptoks, str(p), form, lines)


def write_lengths(path: str | Path, table: Mapping[str | int, Sequence[int]]) -> None:
    """Write a long lengths CSV (``prompt_id,output_tokens``); ids are written as given."""
    with Path(path).open("w", newline="") as fh:
        w = csv.writer(fh)
        w.writerow(["prompt_id", "output_tokens"])
        for pid, ls in table.items():
            for x in ls:
                w.writerow([pid, int(x)])


def match_task_ids(
    table: LengthTable, task_ids: Mapping[int, str | int], task: str
) -> tuple[dict[int, tuple[int, ...]], list[str]]:
    """A lengths file's groups keyed by the task's prompt ids (``task_ids``: prompt id -> the
    task's own id for it, matched as text), and the file ids that name no prompt. Prompts the
    file lacks have no prior, and a file may profile more prompts than a run uses; a file none
    of whose ids name a prompt is an error (the wrong file, or ids from another column), which
    names the file's first line."""
    by_text = {str(ext): pid for pid, ext in task_ids.items()}
    unknown = [x for x in table.ids if x not in by_text]
    if len(unknown) == len(table):
        where = f"{table.source}:{table.lines[0]}" if table.lines else table.source
        some = ", ".join(repr(str(x)) for x in list(task_ids.values())[:5])
        hint = " (task.id_field names the dataset column they come from)" * (task == "dataset")
        raise LengthsFileError(
            f"scheduler.lengths: {where}: column 'prompt_id': {table.ids[0]!r} is not a prompt "
            f"id of task {task!r}, and neither is any other of the file's {len(table)} ids; the "
            f"task's ids look like {some}{hint}"
        )
    prior = {by_text[x]: ls for x, ls in zip(table.ids, table.lengths, strict=True) if x in by_text}
    return prior, unknown


class LengthHistory:
    """Per-prompt running history of observed lengths, with a prompt-length proxy fallback.

    ``predict`` prefers, in order: the prompt's own history (mean of the last ``window``
    observations per sample), the proxy (a least-squares line of mean output length on prompt
    length, fitted on everything observed), the global mean, then ``None`` (unknown).
    """

    def __init__(
        self,
        window: int = 4,
        initial: Mapping[int, Sequence[int]] | None = None,
        prompt_tokens: Mapping[int, int] | None = None,
    ) -> None:
        self.window = window
        self.history: dict[int, list[float]] = {}
        self.prompt_tokens: dict[int, int] = dict(prompt_tokens or {})
        # Sufficient statistics of the proxy regression: n, sx, sy, sxx, sxy.
        self._stats = np.zeros(5)
        self._global = np.zeros(2)
        for pid, ls in (initial or {}).items():
            self.observe(pid, ls)

    def observe(
        self, prompt_id: int, lengths: Sequence[int], prompt_tokens: int | None = None
    ) -> None:
        if not lengths:
            return
        if prompt_tokens is not None:
            self.prompt_tokens[prompt_id] = prompt_tokens
        m = float(np.mean(lengths))
        h = self.history.setdefault(prompt_id, [])
        h.append(m)
        del h[: -self.window]
        self._global += (m, 1.0)
        x = self.prompt_tokens.get(prompt_id)
        if x is not None:
            self._stats += (1.0, x, m, x * x, x * m)

    def proxy(self, prompt_tokens: int) -> float | None:
        """The prompt-length proxy: fitted mean output length for a prompt of this length."""
        n, sx, sy, sxx, sxy = self._stats
        if n < 2:
            return None
        var = n * sxx - sx * sx
        slope = (n * sxy - sx * sy) / var if var > 0 else 0.0
        return max(1.0, (sy - slope * sx) / n + slope * prompt_tokens)

    def predict(self, prompt_id: int, n: int) -> tuple[int, ...] | None:
        h = self.history.get(prompt_id)
        if h:
            v = float(np.mean(h))
        elif (x := self.prompt_tokens.get(prompt_id)) is not None and (
            pv := self.proxy(x)
        ) is not None:
            v = pv
        elif self._global[1] > 0:
            v = self._global[0] / self._global[1]
        else:
            return None
        return (max(1, round(v)),) * n

    def groups(self, prompt_ids: Sequence[int], n: int) -> list[GroupSpec]:
        """``GroupSpec`` list for an epoch over ``prompt_ids`` with the current predictions."""
        return [GroupSpec(p, n, self.predict(p, n)) for p in prompt_ids]


def _ranks(x: np.ndarray) -> np.ndarray:
    """Average ranks (ties share the mean rank), as Spearman's rho needs."""
    order = np.argsort(x, kind="stable")
    ranks = np.empty(len(x))
    ranks[order] = np.arange(len(x), dtype=float)
    _, inv, counts = np.unique(x, return_inverse=True, return_counts=True)
    sums = np.bincount(inv, weights=ranks)
    return sums[inv] / counts[inv]


def predictor_quality(predicted: Sequence[float], actual: Sequence[float]) -> tuple[float, float]:
    """(Spearman rho, MAPE) of ``predicted`` against ``actual`` (aligned, one value each, e.g.
    per-group mean lengths). MAPE divides by max(actual, 1). rho is nan for constant input."""
    p = np.asarray(predicted, dtype=float)
    a = np.asarray(actual, dtype=float)
    if p.shape != a.shape or p.ndim != 1:
        raise ValueError(f"predicted and actual must be aligned 1-D (got {p.shape}, {a.shape})")
    if len(p) == 0:
        return float("nan"), float("nan")
    mape = float(np.mean(np.abs(p - a) / np.maximum(a, 1.0)))
    rp, ra = _ranks(p), _ranks(a)
    sp, sa = rp.std(), ra.std()
    rho = float(np.mean((rp - rp.mean()) * (ra - ra.mean())) / (sp * sa)) if sp and sa else math.nan
    return rho, mape


MIN_RANKED_GROUPS = 3
"""Groups ``longest_quality`` needs before it ranks them (two always rank ±1)."""


def longest_quality(pairs: Sequence[tuple[float, float]]) -> tuple[float | None, float | None]:
    """(Spearman rho, median actual/predicted) over (predicted, actual) longest samples, one
    pair per group, e.g. a trainer step's batch. rho says whether the plan put the right groups
    first, the ratio whether their scale was right (1: exact; divides by max(predicted, 1)).
    rho is None under ``MIN_RANKED_GROUPS`` pairs or when either side is constant; both are
    None with no pair."""
    if not pairs:
        return None, None
    predicted = np.array([p for p, _ in pairs], dtype=float)
    actual = np.array([a for _, a in pairs], dtype=float)
    ratio = float(np.median(actual / np.maximum(predicted, 1.0)))
    if len(pairs) < MIN_RANKED_GROUPS:
        return None, ratio
    rho, _ = predictor_quality(predicted, actual)
    return (None if math.isnan(rho) else rho), ratio
