"""``kfp-elastic forget RUN_ID``: delete every etcd key of a run, so that its run id can be used
again by a new job.

    kfp-elastic forget job-1 --etcd 127.0.0.1:2379

A run's master state, timeline, progress and shard queues outlive it on purpose (a restarted
master or a KFP retry continues from them), and a new job under the same run id is refused
while they are there (``master.state.start_refusal``). The pipeline's exit handler deletes
them at the end of a pipeline run (``components.common.forget_run``, also used here). A run
whose master still leads is not forgotten unless ``--force``: its workers would go on against
keys that are gone. Local worker processes and worker pods are not stopped here.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from kfp_elastic.etcd import settings as etcd_settings


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="kfp-elastic forget",
        description="Delete every etcd key of a run (its run id can then start a new job).",
    )
    parser.add_argument("run_id", help="the run id (--run-id of kfp-elastic master)")
    etcd_settings.add_arguments(parser)
    parser.add_argument(
        "--force", action="store_true", help="also while a master leads the run (stop it first)"
    )
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    from kfp_elastic.components.common import forget_run
    from kfp_elastic.etcd.client import connect
    from kfp_elastic.master.state import MasterState

    parser = build_parser()
    args = parser.parse_args(sys.argv[1:] if argv is None else argv)
    if not args.run_id or "/" in args.run_id:
        parser.error(f"run id must be non-empty and without '/', got {args.run_id!r}")
    try:
        settings = etcd_settings.from_args(args)
    except etcd_settings.ConfigError as error:
        parser.error(str(error))
    client = connect(settings)
    try:
        state = MasterState(client, settings.run_prefix(args.run_id))
        leader, status = state.leader(), state.status()
    finally:
        client.close()
    if leader is not None and not args.force:
        parser.exit(
            2,
            f"kfp-elastic forget: error: run {args.run_id} has a live master "
            f"({leader.get('id', '?')} on host {leader.get('host', '?')}, pid "
            f"{leader.get('pid', '?')}): stop it first (SIGINT cancels the job), or --force\n",
        )
    deleted = forget_run(args.run_id, settings=settings) or 0
    was = f"{status['state']}: {status.get('message') or '-'}" if status else "no master status"
    print(f"run {args.run_id}: deleted {deleted} keys ({was})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
