"""The HTML report of one job: metrics, world size over time, loss curve, restarts and causes.

Self-contained (inline SVG and CSS, no scripts, no downloads), so the KFP UI's HTML viewer and a
browser opening the file from disk show the same page.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from html import escape

from kfp_elastic.components.elastic_train.summary import Summary
from kfp_elastic.contract.prices import NO_PRICES, TIERS, Prices
from kfp_elastic.master.cost import Cost

WIDTH, HEIGHT = 640, 240
PAD_LEFT, PAD_RIGHT, PAD_TOP, PAD_BOTTOM = 56, 16, 16, 40
LOST, INJECTED = "#d33", "#e36209"  # marker colours


def _ticks(low: float, high: float, count: int = 5) -> list[float]:
    if high <= low:
        high = low + 1
    raw = (high - low) / count
    magnitude = 10 ** math.floor(math.log10(raw))
    step = next(m * magnitude for m in (1, 2, 2.5, 5, 10) if m * magnitude >= raw)
    first = math.ceil(low / step) * step
    return [round(first + i * step, 10) for i in range(int((high - first) / step) + 1)]


def _fmt(value: float) -> str:
    return f"{value:.0f}" if float(value).is_integer() else f"{value:.3g}"


def svg_chart(
    segments: Sequence[Sequence[tuple[float, float]]],
    *,
    title: str,
    x_label: str,
    y_label: str,
    step: bool = False,
    y_min: float | None = None,
    markers: Sequence[tuple[float, str, str]] = (),
    integer_y: bool = False,
) -> str:
    """A line chart: each segment is a polyline of (x, y) points; ``step``: a step function;
    ``markers``: vertical dashed lines (x, label, colour), e.g. a worker lost."""
    points = [p for segment in segments for p in segment]
    if not points:
        return f'<p class="empty">{escape(title)}: no data.</p>'
    xs, ys = [p[0] for p in points], [p[1] for p in points]
    x0, x1 = min(xs + [m[0] for m in markers]), max(xs + [m[0] for m in markers])
    y0 = min(ys) if y_min is None else min(y_min, min(ys))
    y1 = max(ys)
    if x1 <= x0:
        x1 = x0 + 1
    if y1 <= y0:
        y1 = y0 + 1
    y1 += (y1 - y0) * 0.08
    plot_w, plot_h = WIDTH - PAD_LEFT - PAD_RIGHT, HEIGHT - PAD_TOP - PAD_BOTTOM

    def sx(x: float) -> float:
        return PAD_LEFT + (x - x0) / (x1 - x0) * plot_w

    def sy(y: float) -> float:
        return PAD_TOP + plot_h - (y - y0) / (y1 - y0) * plot_h

    parts = [
        f'<svg xmlns="http://www.w3.org/2000/svg" viewBox="0 0 {WIDTH} {HEIGHT}" '
        f'width="{WIDTH}" height="{HEIGHT}" role="img" aria-label="{escape(title)}">',
        f'<rect x="{PAD_LEFT}" y="{PAD_TOP}" width="{plot_w}" height="{plot_h}" '
        'fill="#fafafa" stroke="#ccc"/>',
    ]
    y_ticks = _ticks(y0, y1)
    if integer_y:
        y_ticks = [t for t in y_ticks if float(t).is_integer()] or y_ticks
    for tick in y_ticks:
        if y0 <= tick <= y1:
            parts.append(
                f'<line x1="{PAD_LEFT}" x2="{PAD_LEFT + plot_w}" y1="{sy(tick):.1f}" '
                f'y2="{sy(tick):.1f}" stroke="#eee"/>'
                f'<text x="{PAD_LEFT - 6}" y="{sy(tick) + 4:.1f}" text-anchor="end" '
                f'font-size="11">{_fmt(tick)}</text>'
            )
    for tick in _ticks(x0, x1, 6):
        if x0 <= tick <= x1:
            parts.append(
                f'<text x="{sx(tick):.1f}" y="{PAD_TOP + plot_h + 16}" '
                f'text-anchor="middle" font-size="11">{_fmt(tick)}</text>'
            )
    for i, (x, label, colour) in enumerate(sorted(markers)):
        label_y = PAD_TOP + 12 + 12 * (i % 3)  # stagger labels of nearby markers
        parts.append(
            f'<line x1="{sx(x):.1f}" x2="{sx(x):.1f}" y1="{PAD_TOP}" '
            f'y2="{PAD_TOP + plot_h}" stroke="{colour}" stroke-dasharray="4 3">'
            f"<title>{escape(label)}</title></line>"
            + (
                f'<text x="{sx(x) - 3:.1f}" text-anchor="end" '
                if sx(x) > PAD_LEFT + plot_w * 0.6
                else f'<text x="{sx(x) + 3:.1f}" '
            )
            + f'y="{label_y}" font-size="10" fill="{colour}">{escape(label)}</text>'
        )
    for segment in segments:
        coords: list[str] = []
        for i, (x, y) in enumerate(segment):
            if step and i:
                coords.append(f"{sx(x):.1f},{sy(segment[i - 1][1]):.1f}")
            coords.append(f"{sx(x):.1f},{sy(y):.1f}")
        parts.append(
            f'<polyline fill="none" stroke="#1f6feb" stroke-width="2" points="{" ".join(coords)}"/>'
        )
    parts.append(
        f'<text x="{PAD_LEFT + plot_w / 2:.1f}" y="{HEIGHT - 6}" text-anchor="middle" '
        f'font-size="12">{escape(x_label)}</text>'
        f'<text x="14" y="{PAD_TOP + plot_h / 2:.1f}" text-anchor="middle" '
        f'font-size="12" transform="rotate(-90 14 {PAD_TOP + plot_h / 2:.1f})">'
        f"{escape(y_label)}</text></svg>"
    )
    return "".join(parts)


def loss_segments(losses: Sequence[tuple[int, float]]) -> list[list[tuple[float, float]]]:
    """Split where the step goes backwards (a rollback): each run of steps is one line."""
    segments: list[list[tuple[float, float]]] = []
    for step, loss in losses:
        if not segments or step <= segments[-1][-1][0]:
            segments.append([])
        segments[-1].append((float(step), loss))
    return segments


def _table(header: Sequence[str], rows: Sequence[Sequence[object]]) -> str:
    head = "".join(f"<th>{escape(h)}</th>" for h in header)
    body = "".join(
        "<tr>" + "".join(f"<td>{escape(str(c))}</td>" for c in row) + "</tr>" for row in rows
    )
    return f"<table><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>"


def _money(value: float | None) -> str:
    return "-" if value is None else f"{value:.4f}"


def cost_section(cost: Cost, prices: Prices) -> list[str]:
    """Slot-hours per tier, their price and cost, and the same work at a fixed size on
    on-demand nodes (``master.cost``; docs/scheduling.md, "What it costs")."""
    rows: list[tuple[object, ...]] = []
    for tier in TIERS:
        price = prices.of(tier) if prices.given else None
        money = cost.cost[tier] if cost.cost is not None else None
        rows.append((tier, f"{cost.slot_seconds[tier] / 3600:.4f}", _money(price), _money(money)))
    held = sum(cost.slot_seconds.values())
    rows.append(("total", f"{held / 3600:.4f}", "", _money(cost.total)))
    if cost.fixed_slot_seconds is not None:
        rows.append(
            (
                f"fixed size: {cost.fixed_workers} workers, on-demand",
                f"{cost.fixed_slot_seconds / 3600:.4f}",
                _money(prices.on_demand if prices.given else None),
                _money(cost.fixed_cost),
            )
        )
    parts = [
        "<h2>What it costs</h2>",
        _table(("tier", "slot-hours", "price per slot-hour", "cost"), rows),
    ]
    if cost.saving is not None:
        parts.append(f"<p>Saving against the fixed-size job: {cost.saving:.4f}.</p>")
    how = (
        "Slot: one worker pod, held from when the master saw it Running until its end. "
        "Guaranteed: workers 0..min_workers-1 (on-demand price); opportunistic: the others "
        "(spot price, else on-demand)."
    )
    if cost.steps_per_second is not None:
        how += (
            f" Fixed size: the {cost.steps} committed steps at {cost.fixed_workers} workers and "
            f"{cost.steps_per_second:.3g} steps/s, "
            + (
                "measured at that size."
                if cost.throughput_measured
                else "scaled linearly from the largest size measured (never trained at that "
                "size; real scaling is at most linear)."
            )
        )
    else:
        how += " Fixed size: no throughput measured (fewer than two commits in one round)."
    if not prices.given:
        how += " No prices given (on_demand_price, spot_price): slot-hours only."
    parts.append(f'<p class="note">{escape(how)}</p>')
    return parts


def _why_it_failed(summary: Summary) -> list[str]:
    """The master's verdict and the failures counted against the job's budget (where, the
    exception and traceback tail); without those, the errors the failed workers left."""
    if summary.end_state != "failed":
        return []
    parts = ["<h2>Why it failed</h2>", f"<pre>{escape(summary.end_message or 'unknown')}</pre>"]
    if summary.failure_rows:
        parts.append(_table(("t (s)", "worker", "where", "error"), summary.failure_rows))
        return parts
    errors = [(t, w, message) for t, w, cause, message in summary.lost_rows if cause == "failed"]
    if errors:
        parts.append(_table(("t (s)", "worker", "error"), errors))
    return parts


def render(
    summary: Summary,
    *,
    title: str,
    settings: dict[str, object],
    injected: Sequence[tuple[float, str, str]] = (),
    log_dir: str = "",
    prices: Prices = NO_PRICES,
) -> str:
    """The whole page. ``injected``: (seconds since start, fault, worker) of injected faults."""
    markers = [(t, f"{worker} lost ({cause})", LOST) for t, worker, cause, _ in summary.lost_rows]
    markers += [(t, f"{fault} injected", INJECTED) for t, fault, _ in injected]
    world_chart = svg_chart(
        [[(t, float(s)) for t, s in summary.world_size]],
        title="World size over time",
        x_label="seconds since start",
        y_label="processes",
        step=True,
        y_min=0,
        markers=markers,
        integer_y=True,
    )
    loss_chart = svg_chart(
        loss_segments(summary.losses),
        title="Training loss",
        x_label="optimizer step",
        y_label="mean loss",
    )
    metric_rows = [(k, v) for k, v in summary.metrics().items()]
    restart_rows = [
        (r.t, r.round, f"{r.world_before} → {r.world_after}", ", ".join(r.causes))
        for r in summary.restart_rows
    ]
    state = summary.end_state or "unknown"
    sections = [
        f"<h1>{escape(title)}</h1>",
        f'<p class="state {escape(state)}">Job {escape(state)}'
        + (f": {escape(summary.end_message)}" if summary.end_message else "")
        + "</p>",
        *_why_it_failed(summary),
        "<h2>Metrics</h2>",
        _table(("metric", "value"), metric_rows),
        *cost_section(summary.cost, prices),
        "<h2>World size over time</h2>",
        world_chart,
        '<p class="note">Dashed lines: red, a worker lost (hover for the cause); orange, a '
        "fault injected.</p>",
        "<h2>Loss curve</h2>",
        loss_chart,
        '<p class="note">A new line starts where training rolled back to a snapshot.</p>',
        "<h2>Restarts and their causes</h2>",
        _table(("t (s)", "round", "world size", "events since the previous round"), restart_rows)
        if restart_rows
        else "<p>No restarts: the first round trained to the end.</p>",
        "<h2>Workers lost</h2>",
        _table(("t (s)", "worker", "cause", "message"), summary.lost_rows)
        if summary.lost_rows
        else "<p>No worker was lost.</p>",
    ]
    if injected:
        sections += [
            "<h2>Injected faults</h2>",
            _table(("t (s)", "fault", "worker"), [(round(t, 2), f, w) for t, f, w in injected]),
        ]
    sections += ["<h2>Settings</h2>", _table(("setting", "value"), sorted(settings.items()))]
    if log_dir:
        sections.append(f'<p class="note">Worker logs: {escape(log_dir)}</p>')
    style = (
        "body{font-family:system-ui,sans-serif;margin:24px;color:#222;max-width:960px}"
        "table{border-collapse:collapse;margin:8px 0}td,th{border:1px solid #ddd;"
        "padding:4px 8px;text-align:left;font-size:13px}th{background:#f3f3f3}"
        ".note{color:#666;font-size:12px}.state{font-weight:600}"
        ".succeeded{color:#1a7f37}.failed{color:#cf222e}"
    )
    return (
        f'<!DOCTYPE html><html><head><meta charset="utf-8"><title>{escape(title)}'
        f"</title><style>{style}</style></head><body>{''.join(sections)}</body></html>"
    )
