"""kfp_elastic.etcd.keys: the one key schema (pure) and that nobody else builds keys."""

from __future__ import annotations

import itertools
import re
from pathlib import Path

import pytest

from kfp_elastic.etcd import keys as schema
from kfp_elastic.etcd.keys import QUEUE_STATES, RunKeys, prefix_range_end, run_prefix_of

RUN = "/kfp-elastic/job-1"
ROOT = Path(__file__).resolve().parents[3]


def every_key(keys: RunKeys) -> dict[str, str]:
    """One instance of every key (and key prefix) of the schema, by concept."""
    master, timeline, progress = keys.master, keys.timeline, keys.progress
    return {
        "rdzv.run": keys.run,
        "rdzv.node": keys.node("host-1-abc"),
        "rdzv.round": keys.round,
        "rdzv.closed": keys.closed,
        "rdzv.leader": keys.leader,
        "rdzv.rank0": keys.rank0,
        "store": keys.store(3) + "MASTER_ADDR",
        "master.leader": master.leader,
        "master.spec": master.spec,
        "master.status": master.status,
        "master.worker": master.worker("worker-0-0"),
        "master.observed": master.observed,
        "master.event_seq": master.event_seq,
        "event": timeline.event(7),
        "failure": keys.failure("round-3-1f"),
        "progress.committed": progress.committed,
        "progress.base_world_size": progress.base_world_size,
        "shards.manifest": progress.manifest,
        **{f"shards.{s}": progress.queue(2, s, 5) for s in QUEUE_STATES},
    }


def test_every_key_lives_under_the_run_prefix() -> None:
    for concept, key in every_key(RunKeys(RUN)).items():
        assert key.startswith(RUN + "/"), concept
        assert "//" not in key, concept


def test_no_key_is_a_prefix_of_another_concepts_key() -> None:
    """A range read or watch of one concept never returns another concept's keys."""
    built = every_key(RunKeys(RUN))
    for (a, key_a), (b, key_b) in itertools.permutations(built.items(), 2):
        assert not key_b.startswith(key_a), f"{a} ({key_a}) is a prefix of {b} ({key_b})"


def test_parts_have_disjoint_sub_prefixes() -> None:
    keys = RunKeys(RUN)
    roots = [
        keys.rdzv,
        keys.store_root,
        keys.master.root,
        keys.timeline.root,
        keys.progress.root,
        keys.progress.shards,
        keys.failures,
    ]
    assert len(set(roots)) == len(roots)
    for a, b in itertools.permutations(roots, 2):
        assert not b.startswith(a)
    assert all(keys.master.worker("w").startswith(keys.master.workers) for _ in range(1))
    assert keys.store(1).startswith(keys.store_root) and keys.store(1) != keys.store(10)[:-1]


def test_event_keys_sort_in_sequence_order_and_give_back_their_number() -> None:
    timeline = RunKeys(RUN).timeline
    numbers = [1, 2, 9, 10, 99, 100, 12345]
    assert sorted(timeline.event(n) for n in numbers) == [timeline.event(n) for n in numbers]
    assert [timeline.seq_of(timeline.event(n).encode()) for n in numbers] == numbers


def test_run_prefix_of_joins_with_one_slash() -> None:
    assert run_prefix_of("/kfp-elastic", "job-1") == RUN
    assert run_prefix_of("/kfp-elastic/", "job-1") == RUN


def test_queue_state_must_be_known() -> None:
    with pytest.raises(ValueError, match="queue state"):
        RunKeys(RUN).progress.queue(0, "lost", 1)


def test_prefix_range_end_covers_exactly_the_prefix() -> None:
    end = prefix_range_end(f"{RUN}/rdzv/")
    assert f"{RUN}/rdzv/zzz" < end <= f"{RUN}/rdzv0"


def test_the_docstring_table_names_every_key() -> None:
    table = schema.__doc__ or ""
    documented = set(re.findall(r"^\| (\S+/\S*|\S+) +\|", table, re.MULTILINE))
    expected = {
        "rdzv/run",
        "rdzv/nodes/{node_id}",
        "rdzv/round",
        "rdzv/closed",
        "rdzv/leader",
        "rdzv/rank0",
        "store/{N}/{key}",
        "master/leader",
        "master/spec",
        "master/status",
        "master/workers/{name}",
        "master/observed",
        "master/event_seq",
        "events/{seq:010d}",
        "failures/{incident}",
        "progress/committed",
        "progress/base_world_size",
        "shards/manifest",
        *(f"shards/epoch/{{e}}/{state}/{{shard}}" for state in QUEUE_STATES),
    }
    assert expected <= documented
    assert len(expected) == len(every_key(RunKeys(RUN)))


# Key building outside the schema: an f-string that appends a path part to a (run) prefix.
# (A prefix alone followed by "/", as in a permission hint, names no key.)
KEY_BUILDING = re.compile(r"f[\"']\{[^}]*prefix[^}]*\}/[^\"']")


def test_no_module_builds_keys_outside_the_schema() -> None:
    offenders = []
    for folder in ("kfp_elastic",):
        for path in (ROOT / folder).rglob("*.py"):
            if path == Path(schema.__file__).resolve():
                continue
            for number, line in enumerate(path.read_text().splitlines(), 1):
                if KEY_BUILDING.search(line):
                    offenders.append(f"{path.relative_to(ROOT)}:{number}: {line.strip()}")
    assert not offenders, "\n".join(offenders)
    assert not (ROOT / "rendezvous" / "keys.py").exists()
