"""The report's figures as PNG bytes (matplotlib, Agg backend; nothing is shown on screen).

Task ids are long and alike (mined ones read "pkg-1.0:pkg/mod.py::fn"): cutting them to a fixed width makes them
identical, so labels drop what all of them share and keep their distinguishing end (`short_labels`); the Pareto
figure moves labels that would overlap and keeps its legend outside the axes, where it hides no point.
"""

from __future__ import annotations

import io
import os
from typing import Optional, Sequence

import numpy as np

MAX_ROWS = 80  # tasks drawn in a per-task figure; beyond that the lowest-accuracy ones are shown
SEPARATORS = ":/.-_ "


def _common_prefix(texts: list[str]) -> str:
    """The longest prefix of all texts that ends at a separator (so no label starts mid-word)."""
    prefix = os.path.commonprefix(texts)
    while prefix and prefix[-1] not in SEPARATORS:
        prefix = prefix[:-1]
    return prefix


def short_labels(labels: Sequence[str], width: int = 40, keep: Sequence[bool] = ()) -> list[str]:
    """Labels at most `width` characters that stay as distinct as the inputs: the prefix and suffix (at separators)
    all share are dropped, then longer ones keep their head and their (more telling) tail around an ellipsis,
    widened until they differ. Labels marked in `keep` (e.g. "overall") are left alone and share nothing."""
    labels = [str(label) for label in labels]
    kept = [i < len(keep) and bool(keep[i]) for i in range(len(labels))]
    rest = [label for label, k in zip(labels, kept) if not k]
    if len(rest) > 1:
        head = len(_common_prefix(rest))
        tail = len(_common_prefix([r[head:][::-1] for r in rest]))
        if all(r[head:len(r) - tail] for r in rest):
            cut = iter([r[head:len(r) - tail] for r in rest])
            labels = [label if k else next(cut) for label, k in zip(labels, kept)]
    longest = max((len(label) for label in labels), default=0)
    for w in range(max(width, 5), longest + 1):
        out = [label if len(label) <= w else label[:(w - 1) // 3] + "…" + label[len(label) - (w - 1 - (w - 1) // 3):]
               for label in labels]
        if len(set(out)) == len(set(labels)):
            return out
    return labels


def _pyplot():
    import matplotlib

    matplotlib.use("Agg", force=True)
    import matplotlib.pyplot as plt

    return plt


def _png(fig) -> bytes:
    buffer = io.BytesIO()
    fig.savefig(buffer, format="png", dpi=100, bbox_inches="tight")
    _pyplot().close(fig)
    return buffer.getvalue()


def accuracy_intervals(labels: Sequence[str], values: Sequence[float], intervals: Sequence[Sequence[float]],
                       title: str, highlight: Sequence[bool] = ()) -> bytes:
    """One row per label: the accuracy and its interval; highlighted rows (the overall) drawn in another colour."""
    plt = _pyplot()
    rows = len(labels)
    fig, ax = plt.subplots(figsize=(7.5, 1.2 + 0.28 * rows))
    y = np.arange(rows)[::-1]
    low = np.array([v - i[0] for v, i in zip(values, intervals)])
    high = np.array([i[1] - v for v, i in zip(values, intervals)])
    colours = ["#c0392b" if (highlight[i] if i < len(highlight) else False) else "#2c7fb8" for i in range(rows)]
    for i in range(rows):
        ax.errorbar(values[i], y[i], xerr=[[low[i]], [high[i]]], fmt="o", color=colours[i], capsize=3)
    ax.set_yticks(y, short_labels(labels, 48, highlight))
    ax.set_xlim(-0.02, 1.02)
    ax.set_xlabel("accuracy")
    ax.set_title(title, fontsize=10)
    ax.grid(axis="x", alpha=0.3)
    return _png(fig)


def pareto_frontier(xs: Sequence[float], ys: Sequence[float]) -> list[int]:
    """Indices of the points no other point beats on both axes (lower x, higher y), by increasing x."""
    order = sorted(range(len(xs)), key=lambda i: (xs[i], -ys[i]))
    frontier, best = [], -np.inf
    for i in order:
        if ys[i] > best:
            frontier.append(i)
            best = ys[i]
    return frontier


def pareto(labels: Sequence[str], xs: Sequence[float], ys: Sequence[float], xlabel: str, title: str,
           intervals: Optional[Sequence[Sequence[float]]] = None, highlight: Sequence[bool] = ()) -> bytes:
    """Accuracy against a cost axis, the Pareto frontier drawn through the points not dominated."""
    return _png(pareto_figure(labels, xs, ys, xlabel, title, intervals, highlight))


def pareto_figure(labels, xs, ys, xlabel, title, intervals=None, highlight=()):
    """`pareto`'s matplotlib figure: point labels (up to 20 points) moved up until none overlaps another, the
    legend to the right of the axes."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(7.5, 4.5))
    names = short_labels(labels, 30, highlight)
    notes = []
    for i, (x, y) in enumerate(zip(xs, ys)):
        special = highlight[i] if i < len(highlight) else False
        yerr = None if intervals is None else [[y - intervals[i][0]], [intervals[i][1] - y]]
        first = not any((highlight[j] if j < len(highlight) else False) == special for j in range(i))
        ax.errorbar(x, y, yerr=yerr, fmt="*" if special else "o", markersize=12 if special else 6,
                    color="#c0392b" if special else "#2c7fb8", capsize=3, alpha=0.9, zorder=3 if special else 2,
                    label=(names[i] if special else "task") if first else None)
        if len(xs) <= 20:
            notes.append(ax.annotate(names[i], (x, y), textcoords="offset points", xytext=(5, 5), fontsize=8,
                                     annotation_clip=False))
    frontier = pareto_frontier(xs, ys)
    ax.plot([xs[i] for i in frontier], [ys[i] for i in frontier], "--", color="#555555", label="Pareto frontier")
    ax.set_xlabel(xlabel)
    ax.set_ylabel("accuracy")
    ax.set_ylim(-0.05, 1.05)
    if xs and min(xs) > 0 and max(xs) / min(xs) > 50:
        ax.set_xscale("log")
    ax.legend(loc="upper left", bbox_to_anchor=(1.02, 1.0), borderaxespad=0.0, fontsize=8)
    ax.set_title(title, fontsize=10)
    ax.grid(alpha=0.3)
    _separate(fig, ax, notes)
    return fig


def _separate(fig, ax, notes):
    """Place each annotation inside the axes (left or right of its point, above it or, near the top, below) and
    step it away from its point (down in the upper half, up in the lower) until it overlaps no earlier one."""
    renderer = fig.canvas.get_renderer()
    frame = ax.get_window_extent(renderer)
    placed = []
    for note in notes:
        px, py = ax.transData.transform(note.xy)
        upper = py > frame.y0 + 0.5 * frame.height
        note.set_horizontalalignment("right" if px > frame.x0 + 0.6 * frame.width else "left")
        note.xyann = (-5 if note.get_horizontalalignment() == "right" else 5, -12 if upper else 5)
        for _ in range(len(notes) + 1):
            box = note.get_window_extent(renderer)
            if not any(box.overlaps(other) for other in placed):
                break
            dx, dy = note.xyann
            note.xyann = (dx, dy + (-1 if upper else 1) * (box.height * 72.0 / fig.dpi + 1))
        placed.append(note.get_window_extent(renderer))


def heatmap(rows: Sequence[str], columns: Sequence[str], values: np.ndarray, title: str,
            colorbar_label: str = "1 correct, 0 wrong; grey: not run") -> bytes:
    """rows x columns of values in [0, 1] (NaN for missing), e.g. task x pass correctness."""
    plt = _pyplot()
    values = np.asarray(values, dtype=np.float64)
    fig, ax = plt.subplots(figsize=(2.5 + 0.45 * len(columns), 1.2 + 0.26 * len(rows)))
    cmap = plt.get_cmap("RdYlGn").with_extremes(bad="#eeeeee")
    image = ax.imshow(np.ma.masked_invalid(values), cmap=cmap, vmin=0, vmax=1, aspect="auto",
                      interpolation="nearest")
    ax.set_xticks(range(len(columns)), columns, fontsize=8)
    ax.set_yticks(range(len(rows)), short_labels(rows, 48), fontsize=8)
    ax.set_title(title, fontsize=10)
    fig.colorbar(image, ax=ax, fraction=0.05, pad=0.02, label=colorbar_label)
    return _png(fig)
