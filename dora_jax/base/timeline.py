"""Timeline of a run: what each slice and the trainer did, when, at which version.

The runtime records spans; `plot` draws the figure a reader of the DORA paper expects
(`draw`, onto a given Axes): one row per decode slice coloured by the version it served,
weight loads and migrations hatched, and the trainer's steps on their own row, with its waits left
blank so the bubble is visible. A slice that decodes several versions in one call
(`rollout.versions_per_slice` > 1) is striped, each version's height its share of the
busy slots. Colours cycle through ten: any ten consecutive versions, so every set of
co-resident ones (at most K + 1), stay apart.
"""

from __future__ import annotations

import dataclasses
import json
import threading

from dora_jax.base.atomic_files import write_json_atomic


@dataclasses.dataclass(frozen=True)
class Span:
    row: str  # "slice 0", "slice 1", ..., "trainer"
    kind: str  # "decode" | "load" | "migrate" | "eval" | "train"
    start: float
    end: float
    version: int
    slots: dict | None = None  # decode: busy slots per version, when more than one

class Timeline:
    """Thread-safe span recorder; times are seconds since the run started."""

    def __init__(self):
        self._spans: list[Span] = []
        self._lock = threading.Lock()

    def add(self, row: str, kind: str, start: float, end: float, version: int,
            slots: dict | None = None) -> None:
        """`slots`: {version: busy slots} of a decode call serving several versions."""
        if end > start:
            slots = dict(sorted(slots.items())) if slots and len(slots) > 1 else None
            with self._lock:
                self._spans.append(Span(row, kind, start, end, version, slots))

    @property
    def spans(self) -> list[Span]:
        with self._lock:
            return list(self._spans)

    def save_json(self, path: str) -> None:
        """Writes the spans to `path` as JSON, replacing it whole (`write_atomic`)."""
        write_json_atomic(path, [dataclasses.asdict(s) for s in self.spans])

    def plot(self, path: str, title: str = "") -> None:
        plot(self.spans, path, title)


def _merge(spans: list[Span]) -> list[Span]:
    """Joins abutting spans of the same row/kind/version: one bar per stretch."""
    out: list[Span] = []
    for s in sorted(spans, key=lambda s: (s.row, s.start)):
        last = out[-1] if out else None
        if (last and last.row == s.row and last.kind == s.kind and last.version == s.version
                and last.slots == s.slots and s.start - last.end < 1e-3):
            out[-1] = dataclasses.replace(last, end=max(last.end, s.end))
        else:
            out.append(s)
    return out


_HATCH = {"load": "//", "migrate": "xx", "eval": ".."}


def _stripes(s: Span) -> list[tuple[int, float, float]]:
    """(version, bottom, height) of a span's bar of height 0.8: one stripe per
    version by its share of the busy slots, oldest first."""
    if not s.slots:
        return [(s.version, 0.0, 0.8)]
    total, out, bottom = sum(s.slots.values()), [], 0.0
    for v, n in s.slots.items():
        out.append((v, bottom, 0.8 * n / total))
        bottom += 0.8 * n / total
    return out


def load_json(path: str) -> list[Span]:
    """The spans a run saved with `Timeline.save_json` (its workdir's timeline.json)."""
    with open(path) as f:
        spans = [Span(**d) for d in json.load(f)]
    return [dataclasses.replace(s, slots={int(v): n for v, n in s.slots.items()})
            if s.slots else s for s in spans]


def plot(spans: list[Span], path: str, title: str = "") -> None:
    """Writes a PNG: slices x time coloured by version, trainer steps on top."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = len({s.row for s in spans} | {"trainer"})  # the trainer row is always drawn
    fig, ax = plt.subplots(figsize=(12, 1.0 + 0.45 * rows))
    draw(ax, spans, title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def draw(ax, spans: list[Span], title: str = "") -> None:
    """Draws `plot`'s figure onto a matplotlib Axes, so several runs' timelines can
    share one figure (a subplot each)."""
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    spans = _merge(spans)
    slice_rows = sorted({s.row for s in spans if s.row != "trainer"},
                        key=lambda r: int(r.split()[-1]) if r.split()[-1].isdigit() else r)
    rows = ["trainer", *slice_rows]
    versions = sorted({s.version for s in spans} | {v for s in spans for v in s.slots or ()})
    cmap = plt.get_cmap("tab10")
    colour = {v: cmap(v % 10) for v in versions}
    few = len(versions) <= 10
    # One collection per row, stripe, colour and kind: a bar per span took ~4 ms each.
    bars: dict[tuple, list[tuple[float, float]]] = {}
    for s in spans:
        y = rows.index(s.row)
        for v, bottom, height in _stripes(s):
            key = (y - 0.4 + bottom, height, colour[v], s.kind)
            bars.setdefault(key, []).append((s.start, s.end - s.start))
        if s.kind == "train" and few:
            ax.text((s.start + s.end) / 2, y, f"step {s.version}", ha="center",
                    va="center", fontsize=7)
    for (bottom, height, face, kind), xranges in bars.items():
        ax.broken_barh(xranges, (bottom, height), facecolors=face, linewidth=0.4,
                       edgecolor="black" if kind != "decode" else "none",
                       hatch=_HATCH.get(kind))
    ax.set_yticks(range(len(rows)), rows)
    ax.invert_yaxis()
    ax.set_xlabel("seconds")
    marks = [Patch(facecolor="white", edgecolor="black", hatch=_HATCH[k], label=label)
             for k, label in (("load", "weight load"), ("migrate", "migration"),
                              ("eval", "evaluation"))
             if k != "eval" or any(s.kind == k for s in spans)]  # eval: when on
    if few:
        handles = [Patch(color=colour[v], label=f"v{v}") for v in versions]
    else:  # the colour of v is v mod 10
        handles = [Patch(color=cmap(i), label=f"v = {i} mod 10") for i in range(10)]
    ax.legend(handles=handles + marks, loc="upper left", bbox_to_anchor=(1.0, 1.0), fontsize=8)
    ax.set_title(title or "decode slices coloured by policy version; trainer steps on top")
