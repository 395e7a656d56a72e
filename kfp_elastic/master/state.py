"""All of the master's state in etcd, its leadership lease and the run's event timeline.

Keys: ``{run}/master/...`` and ``{run}/events/...`` of the one key schema,
``kfp_elastic.etcd.keys`` (``MasterKeys``, ``TimelineKeys``).

Leadership (the election of ``kfp_elastic.etcd.election``): a master grants a lease (TTL
``lease_ttl``, refreshed every TTL/3) and creates the leader key in a transaction that succeeds
only if the key is absent. A second master watches the key and tries again when it is deleted
(the first master released it, or its lease expired ``lease_ttl`` seconds after it died). Every
write of the leader is a transaction guarded by "the leader key still holds my value", so a
master that lost its lease cannot overwrite the state of the master that replaced it (it gets
:class:`NotLeaderError`).
"""

from __future__ import annotations

import json
import logging
import os
import socket
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import replace
from typing import Any

from pyetcd.client import MultiEndpointEtcd3Client

from kfp_elastic.etcd.client import TRANSIENT_ERRORS, retry
from kfp_elastic.etcd.election import LeaderKey, WriteOutcome
from kfp_elastic.etcd.keys import MasterKeys, TimelineKeys
from kfp_elastic.etcd.leases import KEEPALIVES_PER_TTL, LeaseKeeper, grant
from kfp_elastic.etcd.records import read_json, read_json_prefix
from kfp_elastic.etcd.settings import DEFAULT_OUTAGE_WAIT_S
from kfp_elastic.etcd.transactions import unchanged_since
from kfp_elastic.master.timeline import Event, to_json

log = logging.getLogger(__name__)
# How long a master waits for an unreachable etcd while it asks for leadership.

JOB_STATES = ("running", "succeeded", "failed")
FINISHED_STATES = ("succeeded", "failed")


def _when(t: object) -> str:
    return time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(t)) if isinstance(t, float) else "?"


def _new_id_hint(run_id: str) -> str:
    return (
        f"start the new job under another run id (--run-id), or delete run {run_id}'s keys "
        f"first: kfp-elastic forget {run_id} (with this master's --etcd settings)"
    )


def start_refusal(
    run_id: str,
    origin: str | None,
    status: dict[str, Any] | None,
    leader: dict[str, Any] | None,
    committed_step: int | None,
    holder_dead: bool = False,
) -> str | None:
    """Why a master may not start run ``run_id`` (None: it may). The same run id is a *retry*
    when ``origin`` (who started it: the KFP component passes its KFP run; None for
    ``kfp-elastic master``) equals the stored one: a retry adopts a running job, waits for a
    leader that is going away, and returns a finished job's stored result. Anything else under
    a used run id is a new job that would find the old one's state: refused, except a restart
    of a running job whose master died (that is how a master recovers). ``status``, ``leader``:
    the stored ``master/status`` and ``master/leader``; ``committed_step``: the committed
    training step, if any; ``holder_dead``: the leader's process is known dead (same host)."""
    retry = origin is not None and (status or leader or {}).get("origin") == origin
    if status is not None and status.get("state") in FINISHED_STATES and not retry:
        return (
            f"run {run_id} already {status['state']} at {_when(status.get('t'))}"
            f" ({status.get('message') or 'no message'}); its keys stay in etcd so that a retry "
            f"of that job finds its result. To train again, {_new_id_hint(run_id)}"
        )
    if leader is not None and not retry and not holder_dead:
        return (
            f"run {run_id} has a live master: {leader.get('id', '?')} on host "
            f"{leader.get('host', '?')} (pid {leader.get('pid', '?')}, since "
            f"{_when(leader.get('since'))}). Stop it first (SIGTERM leaves worker pods for the "
            "next master and stops local workers; if it died, its lease ends within "
            "--leader-ttl seconds), or "
            f"{_new_id_hint(run_id)}"
        )
    if status is None and committed_step is not None:
        return (
            f"run {run_id} already holds training progress (committed step {committed_step}) "
            "that no master started (a torchrun job used this run id); a new job would "
            f"continue from it. {_new_id_hint(run_id)[0].upper()}{_new_id_hint(run_id)[1:]}"
        )
    return None


def _alive(pid: object) -> bool:
    if not isinstance(pid, int) or pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


class NotLeaderError(RuntimeError):
    """This master no longer holds the leadership of its run."""


class MasterState:
    """Reads work for anyone; writes need :meth:`acquire` first (they are fenced)."""

    def __init__(
        self,
        client: MultiEndpointEtcd3Client,
        run_prefix: str,
        *,
        lease_ttl: float = 5.0,
        identity: str | None = None,
        origin: str | None = None,
        outage_wait_s: float = DEFAULT_OUTAGE_WAIT_S,
    ) -> None:
        """``origin``: who starts the run (``start_refusal``), kept in the leader key and the
        status. ``outage_wait_s``: how long :meth:`acquire` waits out an unreachable etcd
        (``--etcd-outage-wait``)."""
        if lease_ttl < 2:
            raise ValueError(f"leader lease TTL must be >= 2 s (etcd's minimum), got {lease_ttl}")
        self.client = client
        self.keys = MasterKeys(run_prefix.rstrip("/"))
        self.timeline_keys = TimelineKeys(self.keys.run_prefix)
        self.lease_ttl = lease_ttl
        self.outage_wait_s = outage_wait_s
        self._election = LeaderKey(client, self.keys.leader)
        self.identity = identity or f"{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:6]}"
        self.origin = origin
        self._token = json.dumps(
            {
                "id": self.identity,
                "host": socket.gethostname(),
                "pid": os.getpid(),
                "since": time.time(),
                "origin": origin,
            }
        )
        self._lease = 0
        self._keeper: LeaseKeeper | None = None
        self._leader = False
        self.lost = threading.Event()  # set when leadership was held and then lost
        self._on_lost: Callable[[], None] | None = None
        self._lock = threading.RLock()
        self._listeners: list[Callable[[Event], None]] = []

    # -- leadership ---------------------------------------------------------------------------
    @property
    def is_leader(self) -> bool:
        return self._leader and not self.lost.is_set()

    def leader(self) -> dict[str, Any] | None:
        return read_json(self.client, self.keys.leader)

    def refusal(self, run_id: str, committed_step: int | None) -> str | None:
        """``start_refusal`` for this master, from what etcd holds now."""
        leader = self.leader()
        holder_dead = (
            leader is not None
            and leader.get("host") == socket.gethostname()
            and not _alive(leader.get("pid"))
        )
        return start_refusal(
            run_id, self.origin, self.status(), leader, committed_step, holder_dead
        )

    def acquire(
        self,
        stop: threading.Event | None = None,
        timeout: float | None = None,
        on_lost: Callable[[], None] | None = None,
    ) -> bool:
        """Become the leader; wait (watching the leader key) while another master is.

        Returns False if ``stop`` was set or ``timeout`` passed first. ``on_lost`` is called
        (on the keep-alive thread) if the lease is lost later.
        """
        stop = stop or threading.Event()
        deadline = None if timeout is None else time.monotonic() + timeout
        self._on_lost = on_lost
        if not self._lease:  # a master may start while etcd restarts: ride it out, bounded
            self._lease = retry(
                lambda: grant(self.client, self.lease_ttl),
                self.outage_wait_s,
                "granting the leadership lease",
            )
            self._keeper = LeaseKeeper(
                self.client, self.lease_ttl / KEEPALIVES_PER_TTL, self._lease_lost
            )
            self._keeper.keep(self._lease)
        waiting_logged = False
        unreachable_since: float | None = None
        while not stop.is_set():
            try:
                ok, responses = self._election.campaign(
                    self._token, self._lease, failure=[self._election.read_op()]
                )
            except TRANSIENT_ERRORS as error:  # etcd restarting: wait it out, within bounds
                unreachable_since = unreachable_since or time.monotonic()
                if time.monotonic() - unreachable_since > self.outage_wait_s:
                    raise
                log.warning(
                    "leadership request failed, retrying run=%s error=%r",
                    self.keys.run_prefix,
                    error,
                )
                stop.wait(0.5)
                continue
            unreachable_since = None
            if ok:
                self._leader = True
                log.info(
                    "leadership acquired run=%s master=%s lease=%x",
                    self.keys.run_prefix,
                    self.identity,
                    self._lease,
                )
                return True
            rows = responses[0] if responses else []
            if not rows:
                continue  # the key vanished between compare and read: try again
            holder, meta = rows[0]
            if not waiting_logged:
                log.info(
                    "waiting for leadership run=%s holder=%s",
                    self.keys.run_prefix,
                    holder.decode(errors="replace"),
                )
                waiting_logged = True
            if not self._election.wait_until_vacant(meta.mod_revision, stop, deadline):
                break
        return False

    def _lease_lost(self, lease_id: int) -> None:
        if self._leader and not self.lost.is_set():
            log.error(
                "leadership lost (lease expired) run=%s master=%s",
                self.keys.run_prefix,
                self.identity,
            )
            self.lost.set()
            if self._on_lost is not None:
                self._on_lost()

    def release(self) -> None:
        """Give up leadership at once (revoke the lease, which deletes the leader key)."""
        if self._keeper is not None:
            self._keeper.stop()
            self._keeper = None
        if self._lease:
            try:
                self.client.revoke_lease(self._lease)
            except Exception as error:  # noqa: BLE001 - it expires by itself after the TTL
                log.warning("could not revoke leader lease error=%r", error)
            self._lease = 0
        if self._leader:
            log.info("leadership released run=%s master=%s", self.keys.run_prefix, self.identity)
        self._leader = False

    # -- fenced writes ------------------------------------------------------------------------
    def _fenced(self, success: list[Any], extra_compare: list[Any] | None = None) -> bool:
        """Run ``success`` if we still lead (and ``extra_compare`` holds). False only when the
        extra compare failed; NotLeaderError when leadership is gone."""
        if not self._leader:
            raise NotLeaderError(f"not the leader of {self.keys.run_prefix}")
        outcome = self._election.write(self._token, success, extra_compare or [])
        if outcome is WriteOutcome.NOT_HOLDER:
            self.lost.set()
            raise NotLeaderError(f"another master leads {self.keys.run_prefix} now")
        return outcome is WriteOutcome.WRITTEN

    def _put(self, key: str, value: Any) -> None:
        self._fenced([self.client.transactions.put(key, json.dumps(value))])

    def _get(self, key: str) -> Any:
        return read_json(self.client, key)

    # -- job spec and status ------------------------------------------------------------------
    def spec(self) -> dict[str, Any] | None:
        return self._get(self.keys.spec)

    def save_spec(self, spec: dict[str, Any]) -> None:
        self._put(self.keys.spec, spec)

    def status(self) -> dict[str, Any] | None:
        return self._get(self.keys.status)

    def set_status(self, state: str, message: str = "") -> None:
        if state not in JOB_STATES:
            raise ValueError(f"job state must be one of {JOB_STATES}, got {state!r}")
        record = {"state": state, "message": message, "t": time.time(), "origin": self.origin}
        self._put(self.keys.status, record)

    # -- workers table (also the LocalLauncher's process registry) ----------------------------
    def workers(self) -> dict[str, dict[str, Any]]:
        return read_json_prefix(self.client, self.keys.workers)

    def update_worker(self, name: str, **fields: Any) -> dict[str, Any]:
        """Merge ``fields`` into the worker's record (created if absent); return the record."""
        with self._lock:
            record = self._get(self.keys.worker(name)) or {}
            record.update(fields)
            self._put(self.keys.worker(name), record)
            return record

    def observed(self) -> dict[str, Any]:
        return self._get(self.keys.observed) or {}

    def ladder(self) -> dict[str, Any] | None:
        """The job's stored ``LadderState`` record (None: none yet)."""
        return self._get(self.keys.ladder)

    def save_ladder(self, record: dict[str, Any]) -> None:
        self._put(self.keys.ladder, record)

    def set_observed(self, observed: dict[str, Any]) -> None:
        self._put(self.keys.observed, observed)

    # -- timeline -----------------------------------------------------------------------------
    def add_listener(self, listener: Callable[[Event], None]) -> None:
        """Call ``listener`` with each event this master puts on the timeline, in order, as
        stored (the Kubernetes Events of its decisions: ``master/k8s_events.py``). It must
        not block: it runs in the writer's thread, under the timeline's lock."""
        self._listeners.append(listener)

    def append_event(self, event: Event) -> Event:
        """Put ``event`` on the timeline under the next sequence number, stamped with the
        master's time; return it as stored (``t`` and ``seq`` set), which every listener
        (:meth:`add_listener`) is then given."""
        tx = self.client.transactions
        event = replace(event, t=time.time())
        with self._lock:
            while True:
                value, meta = self.client.get(self.keys.event_seq)
                seq = int(value) + 1 if value is not None else 1
                guard = unchanged_since(
                    self.client, self.keys.event_seq, meta.mod_revision if value is not None else 0
                )
                if self._fenced(
                    [
                        tx.put(self.keys.event_seq, str(seq)),
                        tx.put(self.timeline_keys.event(seq), to_json(event)),
                    ],
                    [guard],
                ):
                    break
            stored = replace(event, seq=seq)
            for listener in self._listeners:  # under the lock: in the timeline's order
                try:
                    listener(stored)
                except Exception:  # noqa: BLE001 - a listener never fails the master's write
                    log.exception("timeline listener failed kind=%s", stored.kind_name)
        return stored
