"""Pictures of schedules: the planned grid as a PNG, measured timelines as a Chrome trace."""

from __future__ import annotations

import json
import re
import statistics
from pathlib import Path

from trainmesh.parallel.pipeline.ir import COMPUTE, Op
from trainmesh.parallel.pipeline.simulate import Costs, SimResult

_COLORS = {Op.FORWARD: (0.2, 0.45, 0.9), Op.BACKWARD: (0.95, 0.55, 0.15),
           Op.BACKWARD_INPUT: (0.95, 0.55, 0.15), Op.WEIGHT: (0.3, 0.7, 0.35)}
_NAME = re.compile(r"^(\d+)([FBIW])(\d+)$")
# A DualPipeV pair taking turns (``executor._pair``): one span for its forward and backward
_PAIR = re.compile(r"^(\d+F\d+)\|(\d+B\d+)$")


def _compute_spans(row: list[tuple[str, float, float]]) -> list[tuple[str, float, float]]:
    """A timeline's compute actions, a pair's span drawn as its forward's first third and its
    backward's rest (the two interleave inside it; F : B = 1 : 2 as the simulator plays)."""
    out = []
    for name, start, end in row:
        pair = _PAIR.match(name)
        if pair:
            cut = start + (end - start) / 3
            out += [(pair.group(1), start, cut), (pair.group(2), cut, end)]
        elif _NAME.match(name):
            out.append((name, start, end))
    return out


def chrome_trace(timelines: list[list[tuple[str, float, float]]],
                 planned: SimResult | None = None) -> dict:
    """Measured (name, start, end) per rank → Chrome/Perfetto trace events, one row per rank
    (process "measured", category "compute" or "p2p"); with ``planned`` (the simulator fed the
    measured costs), the same ranks again below (process "planned", category "planned"), on
    the same time axis from the step's start: one view of plan against measurement."""
    t0 = min((s for row in timelines for _, s, _ in row), default=0.0)
    events = [{"name": "process_name", "ph": "M", "pid": 0, "args": {"name": "measured"}}]
    for rank, row in enumerate(timelines):
        events.append({"name": "thread_name", "ph": "M", "pid": 0, "tid": rank,
                       "args": {"name": f"rank {rank}"}})
        for name, start, end in row:
            kind = "compute" if _NAME.match(name) or _PAIR.match(name) else "p2p"
            events.append({"name": name, "cat": kind, "ph": "X", "pid": 0, "tid": rank,
                           "ts": (start - t0) * 1e6, "dur": max(0.0, end - start) * 1e6})
    if planned is not None:
        events.append({"name": "process_name", "ph": "M", "pid": 1, "args": {"name": "planned"}})
        for rank, row in enumerate(planned.timeline):
            events.append({"name": "thread_name", "ph": "M", "pid": 1, "tid": rank,
                           "args": {"name": f"rank {rank}"}})
            events += [{"name": str(a), "cat": "planned", "ph": "X", "pid": 1, "tid": rank,
                        "ts": start * 1e6, "dur": (end - start) * 1e6}
                       for a, start, end in row if a.op in COMPUTE]
    return {"traceEvents": events, "displayTimeUnit": "ms"}


def measured_costs(timelines: list[list[tuple[str, float, float]]]) -> Costs:
    """Median seconds of each kind of stage action in measured timelines, for the simulator
    (a split backward's halves as measured; the latency: the shortest communication batch;
    a DualPipeV pair taking turns is neither, its forward and backward interleaved in one
    span: not counted)."""
    spans: dict[str, list[float]] = {}
    comm: list[float] = []
    for row in timelines:
        for name, start, end in row:
            m = _NAME.match(name)
            if m:
                spans.setdefault(m.group(2), []).append(end - start)
            elif not _PAIR.match(name):
                comm.append(end - start)
    med = {op: statistics.median(v) for op, v in spans.items()}
    backward = med.get("B", med.get("I", 0.0) + med.get("W", 0.0))
    return Costs(forward=med.get("F", 0.0), backward=backward, send_latency=min(comm, default=0.0),
                 input=med.get("I"), weight=med.get("W"))


def write_json(obj: dict, path: str | Path) -> Path:
    p = Path(path)
    p.write_text(json.dumps(obj))
    return p


def schedule_figure(sim: SimResult, title: str,
                    measured: list[list[tuple[str, float, float]]] | None = None):
    """The simulated schedule as a figure: one row per rank, one box per stage action (one
    chunk of one microbatch), coloured by kind (forward, backward, or a split backward's input
    and weight halves) and shaded by the rank's chunk, labelled stage-kind-microbatch; a legend
    says all of it. Time is in units of one chunk's forward unless ``measured`` timelines
    (seconds) are given: they are drawn in a second panel on the same axis (the plan then in
    seconds too: simulate with ``measured_costs``)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    pp = len(sim.timeline)
    panels = 2 if measured is not None else 1
    span = sim.step_time if measured is None else max(
        sim.step_time, max((e for row in measured for _, _, e in row), default=0.0)
        - min((s for row in measured for _, s, _ in row), default=0.0))
    width = max(9.0, min(40.0, (len(sim.timeline[0]) * 0.25 if measured else sim.step_time * 0.3)))
    fig, axes = plt.subplots(panels, 1, figsize=(width, (0.6 * pp + 1.6) * panels), squeeze=False)
    rows = [[(a, s, e) for a, s, e in row if a.op in COMPUTE] for row in sim.timeline]
    chunks = 1 + max((a.stage // pp for row in rows for a, _, _ in row), default=0)
    _draw(axes[0][0], rows, pp, chunks, f"{title} — planned, bubble {sim.bubble_fraction:.1%}")
    if measured is not None:
        t0 = min((s for row in measured for _, s, _ in row), default=0.0)
        parsed = [[(_action(n), s - t0, e - t0) for n, s, e in _compute_spans(row)]
                  for row in measured]
        _draw(axes[1][0], parsed, pp, chunks, "measured (last step)")
        for ax in axes[:, 0]:
            ax.set_xlim(0, span)
            ax.set_xlabel("seconds")
    else:
        axes[0][0].set_xlabel("time (one chunk's forward = 1)")
    _legend(fig, rows, pp, chunks)
    fig.tight_layout(rect=(0, 0, 1, 0.84 if panels == 1 else 0.92))
    return fig


def plot_schedule(sim: SimResult, title: str, path: str | Path,
                  measured: list[list[tuple[str, float, float]]] | None = None) -> Path:
    """:func:`schedule_figure` written to ``path`` as a PNG."""
    import matplotlib.pyplot as plt

    fig = schedule_figure(sim, title, measured)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return Path(path)


_KIND_NAME = {Op.FORWARD: "F forward", Op.BACKWARD: "B backward",
              Op.BACKWARD_INPUT: "I backward, input half", Op.WEIGHT: "W backward, weight half"}


def _shade(chunk: int, chunks: int) -> float:
    return 0.35 + 0.5 * chunk / max(1, chunks - 1) if chunks > 1 else 0.6


def _legend(fig, rows, pp: int, chunks: int) -> None:
    from matplotlib.patches import Patch

    kinds = [op for op in _KIND_NAME if any(a.op is op for row in rows for a, _, _ in row)]
    handles = [Patch(facecolor=(*_COLORS[op], 0.6), edgecolor="black", label=_KIND_NAME[op])
               for op in kinds]
    if chunks > 1:  # which stages a rank's chunks hold: rank r holds stages r, r+pp, ...
        handles += [Patch(facecolor=(0.5, 0.5, 0.5, _shade(c, chunks)), edgecolor="black",
                          label=f"chunk {c}: stages {c * pp}–{c * pp + pp - 1}")
                    for c in range(chunks)]
    a = next((a for row in rows for a, _, _ in row if a.op is not Op.FORWARD), rows[0][0][0])
    handles.append(Patch(facecolor="none", edgecolor="none", label=f"box label: stage, kind, "
                         f"microbatch ({a}: stage {a.stage}, {a.op.value}, microbatch {a.microbatch})"))
    fig.legend(handles=handles, loc="upper center", ncol=min(len(handles), 3), fontsize=9,
               frameon=False)


def _action(name: str):
    from trainmesh.parallel.pipeline.ir import Action

    stage, op, mb = _NAME.match(name).groups()
    return Action(Op(op), int(stage), int(mb))


def _draw(ax, rows, pp: int, chunks: int, title: str) -> None:
    for rank, row in enumerate(rows):
        for a, start, end in row:
            shade = _shade(a.stage // pp, chunks)
            ax.broken_barh([(start, end - start)], (pp - 1 - rank + 0.1, 0.8),
                           facecolors=(*_COLORS[a.op], shade), edgecolors="black", linewidth=0.5)
            ax.text((start + end) / 2, pp - 1 - rank + 0.5, str(a), ha="center", va="center",
                    fontsize=7)
    ax.set_yticks([pp - 1 - r + 0.5 for r in range(pp)], [f"rank {r}" for r in range(pp)])
    ax.set_title(title)
