"""Convergence under elasticity: the same model trained by a gang job and by an elastic one.

    python -m benchmarks scheduling convergence            # world 2, 12 epochs (a few minutes)
    python -m benchmarks scheduling convergence --world 4  # 4 processes on the 2-core machine
    python -m benchmarks scheduling convergence --quick    # 2 short epochs, no growth: the plumbing

Both runs train ``kfp_elastic.testing.model_defs.clustered_classes`` (ten overlapping classes,
≈ 88 % held-out accuracy) for real: local torchrun agents (``kfp_elastic.testing.nodes``
``AgentGroup``, one worker process each, elastic-etcd rendezvous on an embedded etcd), the
``linear`` batch policy (every worker keeps ``--batch-size``: LR × world / base world, the base
world being ``--world``) and the model definition's step-wise decay (``LR_DECAY``: × 0.1 at
epochs 7 and 10, counted in samples seen: ``worker/policy.py``).

- gang: ``--world`` agents from start to end;
- elastic: ``--world // 2`` agents (the other half of the slots is held by another job), then,
  when the committed record reaches epoch ``--grow-at`` (the other job ends), the other
  ``--world - --world // 2`` agents join: a real membership change (the running world stops at
  a step, snapshots, and the bigger world restores it).

Rank 0 snapshots at every epoch end (``--snapshot-every`` is set beyond the run's steps); this
process polls the committed record in etcd, keeps each epoch end's model from its snapshot, and
after the run evaluates each on the held-out split (``kfp_elastic.worker.evaluate``). The result
holds both curves, every commit of both runs (world size, effective LR and global batch) and the
verdict: PASS when the final held-out accuracies differ by at most ``--goal-points`` (0.5)
percentage points. The figure (next to the JSON, ``.png``) draws held-out accuracy and loss of
both runs per epoch, and the elastic run's world size and LR over its optimizer steps.
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import torch

from benchmarks.harness import (
    RESULTS,
    export_checkout_to_children,
    git_commit,
    group_log,
    parse_options,
    run_in_work_dir,
    start_etcd,
    suite_parser,
    write_result,
)
from kfp_elastic.etcd.client import connect
from kfp_elastic.testing.model_defs import clustered_classes as task
from kfp_elastic.testing.nodes import AgentGroup, new_run_id
from kfp_elastic.worker.evaluate import evaluate
from kfp_elastic.worker.progress import Committed, Progress
from kfp_elastic.worker.snapshot import read_state

log = logging.getLogger(__name__)

MODEL_DEF = "kfp_elastic.testing.model_defs.clustered_classes"
QUICK = {"epochs": 2, "grow_at": None, "world": 2, "batch_size": 128}
POLL_S = 0.05  # the committed record is read this often (an epoch takes seconds)
SNAPSHOT_EVERY = 10**9  # beyond any run: snapshots at epoch ends (and stops) only
LAST_CALL_S = 1  # rendezvous: wait this long for more nodes once the minimum is there


def build_parser() -> argparse.ArgumentParser:
    """``python -m benchmarks scheduling convergence``'s options."""
    parser = suite_parser(
        "python -m benchmarks scheduling convergence",
        __doc__,
        f"--epochs {QUICK['epochs']} --world {QUICK['world']} --batch-size "
        f"{QUICK['batch_size']}, no growth: the elastic run stays at half the world",
    )
    parser.add_argument(
        "--world", type=int, default=2, help="the gang's world size, the elastic run's maximum"
    )
    parser.add_argument("--epochs", type=int, default=12)
    parser.add_argument(
        "--grow-at", type=int, default=4, help="elastic: the epoch after which it grows"
    )
    parser.add_argument("--batch-size", type=int, default=32, help="samples per worker and step")
    parser.add_argument(
        "--goal-points", type=float, default=0.5, help="PASS: final accuracies this close"
    )
    parser.add_argument(
        "--run-timeout", type=float, default=900.0, help="seconds one training run may take"
    )
    parser.add_argument("--keep-logs", action="store_true", help="keep the work directory")
    return parser


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    """The options, checked, with ``--quick`` applied."""
    parser = build_parser()
    args = parse_options(parser, argv)
    if args.quick:
        args.epochs, args.grow_at = QUICK["epochs"], QUICK["grow_at"]
        args.world, args.batch_size = QUICK["world"], QUICK["batch_size"]
    if args.world < 2:
        parser.error("--world must be >= 2 (the elastic run starts at half of it)")
    if args.epochs < 1 or args.batch_size < 1:
        parser.error("--epochs and --batch-size must be >= 1")
    if args.grow_at is not None and not 0 < args.grow_at < args.epochs:
        parser.error(f"--grow-at must be between 1 and --epochs - 1 ({args.epochs - 1})")
    if args.goal_points < 0 or args.run_timeout <= 0:
        parser.error("--goal-points must be >= 0 and --run-timeout > 0")
    return args


# --------------------------------------------------------------------------- pure parts


@dataclass(frozen=True)
class Plan:
    """How one run's world is made: ``first`` agents at the start, ``later`` more once the
    committed record reaches epoch ``grow_at``; the rendezvous admits ``nnodes``."""

    name: str
    first: int
    later: int
    grow_at: int | None
    nnodes: str


def plans(world: int, grow_at: int | None) -> list[Plan]:
    """The gang run (``world`` from start to end) and the elastic one (half, then all; only
    half when ``grow_at`` is None)."""
    half = world // 2
    later = 0 if grow_at is None else world - half
    return [
        Plan("gang", world, 0, None, f"{world}:{world}"),
        Plan("elastic", half, later, grow_at, f"{half}:{world}"),
    ]


def commit_row(record: Committed, samples: int) -> dict[str, Any]:
    """One commit as the result keeps it; ``progress``: epochs of data (epoch + fraction)."""
    return {
        "step": record.step,
        "epoch": record.epoch,
        "position": record.position,
        "progress": round(record.epoch + record.position / max(1, samples), 4),
        "world": record.world_size,
        "lr": record.lr,
        "global_batch": record.global_batch,
        "stopping": record.stopping,
        "rescued": record.rescued,
        "train_loss": round(sum(record.losses) / len(record.losses), 5) if record.losses else None,
        "at": record.at,
    }


def worlds_seen(commits: Sequence[Mapping[str, Any]]) -> list[int]:
    """The world sizes in the order the run had them (consecutive repeats merged)."""
    seen: list[int] = []
    for row in commits:
        if row["world"] and (not seen or seen[-1] != row["world"]):
            seen.append(row["world"])
    return seen


def verdict(gang: float, elastic: float, goal_points: float) -> dict[str, Any]:
    """Final accuracies (0..1) → their difference in percentage points and PASS/FAIL."""
    difference = (elastic - gang) * 100
    return {
        "gang_final_accuracy": round(gang, 4),
        "elastic_final_accuracy": round(elastic, 4),
        "difference_points": round(difference, 2),
        "goal_points": goal_points,
        "verdict": "PASS" if abs(difference) <= goal_points + 1e-9 else "FAIL",
    }


# --------------------------------------------------------------------------- one run


@dataclass
class Watched:
    """What polling one run's committed record gathered."""

    commits: list[dict[str, Any]] = field(default_factory=list)
    models: dict[int, dict[str, torch.Tensor]] = field(default_factory=dict)  # epoch -> weights
    missed: list[int] = field(default_factory=list)  # epoch ends whose snapshot was unreadable


def _worker_args(args: argparse.Namespace, etcd_endpoint: str, run_dir: Path) -> list[str]:
    return [
        "kfp_elastic.worker",
        "--model-def",
        MODEL_DEF,
        "--epochs",
        str(args.epochs),
        "--batch-size",
        str(args.batch_size),
        "--policy",
        "linear",
        "--base-world-size",
        str(args.world),
        "--snapshot-every",
        str(SNAPSHOT_EVERY),
        "--snapshot-dir",
        str(run_dir / "snapshots"),
        "--etcd",
        etcd_endpoint,
        "--output",
        str(run_dir / "model.pt"),
    ]


def _watch(
    progress: Progress,
    snapshot_dir: Path,
    samples: int,
    running: Callable[[], bool],
    grow: Callable[[int], None],
    deadline: float,
) -> Watched:
    """Poll the committed record until the agents end: every new commit, and the model of
    every epoch end (read from its snapshot at once: rank 0 keeps only the last few).
    ``grow(epoch)`` is called with each newly committed epoch."""
    watched, revision = Watched(), 0
    while running():
        if time.monotonic() > deadline:
            raise TimeoutError("the run did not finish within --run-timeout")
        record, new_revision = progress.committed_record()
        if record is not None and new_revision != revision:
            revision = new_revision
            watched.commits.append(commit_row(record, samples))
            if record.position == 0 and record.snapshot and record.epoch not in watched.models:
                try:
                    state = read_state(snapshot_dir / record.snapshot)
                    watched.models[record.epoch] = state["model"]
                except Exception as error:  # noqa: BLE001 - a gap in the curve, said so
                    log.warning("epoch %d snapshot unreadable: %r", record.epoch, error)
                    watched.missed.append(record.epoch)
            grow(record.epoch)
        time.sleep(POLL_S)
    return watched


def train(
    args: argparse.Namespace, plan: Plan, etcd: Any, work_dir: Path, stack: contextlib.ExitStack
) -> dict[str, Any]:
    """One real training run by ``plan``; its curve, commits and final accuracy."""
    run_id = new_run_id(f"convergence-{plan.name}")
    run_dir = work_dir / plan.name
    run_dir.mkdir()
    group = stack.enter_context(AgentGroup(run_dir))
    script_args = _worker_args(args, etcd.endpoint, run_dir)

    def start(count: int) -> None:
        for _ in range(count):
            group.start(
                backend="elastic-etcd",
                endpoint=etcd.endpoint,
                run_id=run_id,
                nnodes=plan.nnodes,
                script="-m",
                script_args=script_args,
                name=f"{plan.name}{len(group.agents)}",
                rdzv_conf={"last_call_timeout": LAST_CALL_S},
            )

    grown = [plan.later == 0]
    grow_requested: dict[str, Any] = {}  # when the later agents were started

    def grow(epoch: int) -> None:
        if not grown[0] and plan.grow_at is not None and epoch >= plan.grow_at:
            grown[0] = True
            grow_requested.update(epoch=epoch, at=time.time())
            print(f"{plan.name}: epoch {epoch} committed, {plan.later} more agent(s) join")
            start(plan.later)

    client = connect(etcd.client_settings())
    stack.callback(client.close)
    progress = Progress(client, f"/kfp-elastic/{run_id}")
    began = time.monotonic()
    start(plan.first)
    watched = _watch(
        progress,
        run_dir / "snapshots",
        task.TRAIN_SAMPLES,
        lambda: any(agent.alive() for agent in group.agents),
        grow,
        began + args.run_timeout,
    )
    wall = time.monotonic() - began
    codes = [agent.wait(10) for agent in group.agents]
    if codes != [0] * len(codes) or not (run_dir / "model.pt").is_file():
        raise RuntimeError(
            f"{plan.name} run failed: exit codes {codes}\n{group_log(group)[-4000:]}"
        )
    curve = []
    for epoch, weights in sorted(watched.models.items()):
        path = run_dir / f"epoch-{epoch}.pt"
        torch.save(weights, path)
        result = evaluate(MODEL_DEF, path)
        curve.append(
            {"epoch": epoch, "accuracy": round(result.accuracy, 4), "loss": round(result.loss, 4)}
        )
    final = evaluate(MODEL_DEF, run_dir / "model.pt")
    print(
        f"{plan.name}: worlds {worlds_seen(watched.commits)}, final held-out accuracy "
        f"{final.accuracy:.4f} loss {final.loss:.4f} ({wall:.0f} s)",
        flush=True,
    )
    return {
        "agents": {"first": plan.first, "later": plan.later, "grow_at_epoch": plan.grow_at},
        "nnodes": plan.nnodes,
        "worlds": worlds_seen(watched.commits),
        "grow_requested": grow_requested or None,
        "wall_s": round(wall, 1),
        "final_accuracy": round(final.accuracy, 4),
        "final_loss": round(final.loss, 4),
        "curve": curve,
        "missed_epochs": watched.missed,
        "commits": watched.commits,
    }


# --------------------------------------------------------------------------- figure


def plot(runs: Mapping[str, Mapping[str, Any]], out: Path, title: str) -> None:
    """Held-out accuracy and loss per epoch of every run; the elastic run's world size and
    effective LR over its optimizer steps."""
    from benchmarks.scheduling.figures import pyplot, save

    plt = pyplot()

    fig, (acc_ax, loss_ax, world_ax) = plt.subplots(3, 1, figsize=(8, 10))
    styles = {"gang": ("tab:blue", "-o"), "elastic": ("tab:orange", "--s")}
    for name, run in runs.items():
        colour, style = styles.get(name, ("tab:gray", "-"))
        epochs = [point["epoch"] for point in run["curve"]]
        label = f"{name} (final {run['final_accuracy'] * 100:.2f} %)"
        acc_ax.plot(
            epochs, [p["accuracy"] * 100 for p in run["curve"]], style, color=colour, label=label
        )
        loss_ax.plot(epochs, [p["loss"] for p in run["curve"]], style, color=colour, label=name)
    acc_ax.set(ylabel="held-out accuracy (%)", title=title)
    loss_ax.set(xlabel="epochs of data", ylabel="held-out loss")
    for axis in (acc_ax, loss_ax):
        axis.grid(alpha=0.3)
        axis.legend()
    elastic = runs.get("elastic")
    if elastic and elastic["commits"]:
        commits = elastic["commits"]
        # A commit's world and LR are those of the steps since the previous commit.
        steps = [0] + [row["step"] for row in commits]
        worlds = [commits[0]["world"]] + [row["world"] for row in commits]
        lrs = [commits[0]["lr"]] + [row["lr"] for row in commits]
        world_ax.step(steps, worlds, where="pre", color="tab:orange", label="world size")
        world_ax.set(xlabel="elastic run: optimizer steps", ylabel="world size (orange)")
        world_ax.set_ylim(0, max(worlds) + 1)
        world_ax.yaxis.get_major_locator().set_params(integer=True)
        lr_ax = world_ax.twinx()
        lr_ax.step(steps, lrs, where="pre", color="tab:green", label="effective LR")
        lr_ax.set_yscale("log")
        lr_ax.set_ylabel("effective LR (green)")
        world_ax.grid(alpha=0.3)
    save(fig, out, dpi=110)


# --------------------------------------------------------------------------- main


def _default_out(args: argparse.Namespace) -> Path | None:
    """``benchmarks/results/scheduling/convergence-<date>-<commit>.json`` for a full run."""
    if args.out is not None or args.quick:
        return args.out
    commit, _ = git_commit()
    date = datetime.now(timezone.utc).strftime("%Y-%m-%d")
    return RESULTS / "scheduling" / f"convergence-{date}-{commit}.json"


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    args.out = _default_out(args)
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    began = time.time()
    export_checkout_to_children()
    runs: dict[str, dict[str, Any]] = {}

    def body(work_dir: Path, stack: contextlib.ExitStack) -> None:
        etcd = start_etcd(stack, work_dir)
        for plan in plans(args.world, args.grow_at):
            with contextlib.ExitStack() as run_stack:
                runs[plan.name] = train(args, plan, etcd, work_dir, run_stack)

    code, work_dir = run_in_work_dir("convergence-", args.keep_logs, body)
    if code != 0:
        print(f"error: the experiment did not complete (logs: {work_dir})", file=sys.stderr)
        return code
    summary = verdict(
        runs["gang"]["final_accuracy"], runs["elastic"]["final_accuracy"], args.goal_points
    )
    summary["elastic_worlds"] = "->".join(map(str, runs["elastic"]["worlds"]))
    report = {"experiment": "convergence", "model_def": MODEL_DEF, "runs": runs}
    out = write_result("scheduling", args, began, True, summary, report)
    figure = out.with_suffix(".png")
    plot(
        runs,
        figure,
        f"gang (world {args.world}) vs elastic ({'->'.join(map(str, runs['elastic']['worlds']))})"
        f", LR x world, x{task.LR_DECAY['gamma']} at epochs {task.LR_DECAY['epochs']}",
    )
    print(f"wrote {figure}")
    print(
        f"final held-out accuracy: gang {summary['gang_final_accuracy'] * 100:.2f} %, elastic "
        f"{summary['elastic_final_accuracy'] * 100:.2f} %, difference "
        f"{summary['difference_points']:+.2f} points: {summary['verdict']} "
        f"(goal <= {args.goal_points} points)",
        flush=True,
    )
    return 0
