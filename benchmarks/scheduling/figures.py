"""The scheduling benchmarks' figures (matplotlib, written as PNG next to the result's JSON):
:func:`pyplot` and :func:`save`, which every figure of them uses, and the simulation's own.

:func:`plot_loads`: average JCT and mean pending time against the load, gang against elastic,
one column per cluster size, from the result's ``runs``. A workload run (experiment 1) draws the
slots each job holds over time with ``benchmarks/scheduling/occupancy.py``'s ``plot_slots``.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

HOUR = 3600.0
STYLE = {"gang": ("tab:red", "s"), "elastic": ("tab:blue", "o")}


def pyplot() -> Any:
    """``matplotlib.pyplot`` drawing to files only (no display), imported when first drawn:
    an experiment that writes no figure does not pay the import."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def save(fig: Any, path: Path, dpi: int = 100) -> Path:
    """Lay ``fig`` out, write it as a PNG at ``path`` (its directory made) and free it."""
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=dpi)
    pyplot().close(fig)
    return path


def png_next_to(json_path: Path) -> Path:
    """The figure's path: the result's stem + ``.png``."""
    return json_path.with_suffix(".png")


def load_title(settings: Mapping[str, Any]) -> str:
    """The figure's title: the workload and the model (a result's ``settings``)."""
    return (
        f"{Path(str(settings['trace'])).name}, hours {settings['start_hour']:g}"
        f"+{settings['window_hours']:g}, seed {settings['seed']}\n{settings['scaling']} scaling, "
        f"elastic MIN {settings['min_workers']}, join {settings['join_s']:g} s, "
        f"shrink {settings['shrink_s']:g} s"
    )


def plot_loads(runs: Sequence[Mapping[str, Any]], path: Path, title: str) -> Path:
    """Average JCT (top) and mean pending time (bottom), hours, against the jobs submitted in
    the window, one line per policy, one column per cluster size. Writes a PNG."""
    plt = pyplot()

    sizes = sorted({run["gpus"] for run in runs})
    fig, axes = plt.subplots(
        2, len(sizes), figsize=(max(6.4, 4.2 * len(sizes)), 6), squeeze=False, sharex="col"
    )
    for column, gpus in enumerate(sizes):
        mine = sorted((r for r in runs if r["gpus"] == gpus), key=lambda r: r["jobs"])
        policies = sorted({p for r in mine for p in r["policies"]})
        for row, (metric, label) in enumerate(
            (("avg_jct_s", "average JCT (h)"), ("mean_pending_s", "mean pending (h)"))
        ):
            ax = axes[row][column]
            for policy in policies:
                points = [
                    (r["jobs"], r["policies"][policy][metric] / HOUR)
                    for r in mine
                    if policy in r["policies"]
                ]
                color, marker = STYLE.get(policy, (None, "x"))
                ax.plot(*zip(*points, strict=True), marker=marker, color=color, label=policy)
            ax.set_ylabel(label)
            ax.grid(alpha=0.3)
            if row == 0:
                ax.set_title(f"{gpus} GPUs", fontsize=9)
            else:
                ax.set_xlabel("jobs submitted in the window")
        axes[0][column].legend(fontsize=8)
    fig.suptitle(title, fontsize=10)
    return save(fig, path)
