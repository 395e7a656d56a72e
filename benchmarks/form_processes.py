"""Round formation with the N handlers spread over several processes (as agents on N hosts
would be, as far as 2 cores allow): used by ``python -m benchmarks rendezvous --form-processes P``.

The parent starts P children (``python -m benchmarks.form_processes SPEC.json INDEX``); each
creates its share of handlers, prints ``ready``, waits for ``go`` on stdin, calls
``next_rendezvous()`` in one thread per handler, prints one JSON line of results (wall-clock
finish times and ranks) and shuts its handlers down when the parent sends ``exit``. Seconds =
the last finish time minus the ``go`` time.
"""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from benchmarks.harness import REPO_ROOT

# After all returned: time for work a handler does in the background (members' full view).
SETTLE_S = 1.0


def _child(spec_path: str, child_index: int) -> int:
    from torch.distributed.elastic.rendezvous import RendezvousParameters
    from torch.distributed.elastic.rendezvous.registry import get_rendezvous_handler

    spec = json.loads(Path(spec_path).read_text())
    if spec["disable_shared_store"]:
        os.environ["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"] = "1"
    indices = [i for i in range(spec["size"]) if i % spec["processes"] == child_index]
    handlers = {
        i: get_rendezvous_handler(
            RendezvousParameters(
                backend=spec["backend"],
                endpoint=spec["endpoint"],
                run_id=spec["run_id"],
                min_nodes=spec["size"],
                max_nodes=spec["size"],
                **spec["conf"][str(i)],
            )
        )
        for i in indices
    }
    print("ready", flush=True)
    if sys.stdin.readline().strip() != "go":
        return 1
    results: dict[int, Any] = {}

    def join(index: int) -> None:
        try:
            info = handlers[index].next_rendezvous()
            rank = info.rank if hasattr(info, "rank") else info[1]
            results[index] = {"t": time.time(), "rank": rank}
        except Exception as error:  # noqa: BLE001 - reported to the parent
            results[index] = {"error": f"{type(error).__name__}: {error}"}

    threads = [threading.Thread(target=join, args=(i,), daemon=True) for i in indices]
    for thread in threads:
        thread.start()
    deadline = time.monotonic() + spec["timeout"]
    for thread in threads:
        thread.join(max(0.0, deadline - time.monotonic()))
    print(json.dumps({str(k): v for k, v in results.items()}), flush=True)
    sys.stdin.readline()  # "exit": every process has its results; now leave
    for handler in handlers.values():
        with contextlib.suppress(Exception):
            handler.shutdown()
    os._exit(0)


def form_round_processes(
    backend: str,
    endpoint: str,
    run_id: str,
    size: int,
    conf: dict[int, dict[str, object]],
    processes: int,
    timeout: float,
    disable_shared_store: bool,
    checkpoints: Callable[[str], None] | None = None,
) -> tuple[float | None, str | None]:
    """(seconds until all N returned, error). ``checkpoints`` is called with ``"go"`` just
    before the handlers start, ``"returned"`` once all have returned and ``"settled"``
    ``SETTLE_S`` later, before they shut down (for the etcd traffic of each phase)."""
    mark = checkpoints or (lambda _phase: None)
    processes = max(1, min(processes, size))
    with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as spec_file:
        json.dump(
            {
                "backend": backend,
                "endpoint": endpoint,
                "run_id": run_id,
                "size": size,
                "processes": processes,
                "timeout": timeout,
                "disable_shared_store": disable_shared_store,
                "conf": {str(k): v for k, v in conf.items()},
            },
            spec_file,
        )
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join(
            p for p in (str(REPO_ROOT), os.environ.get("PYTHONPATH", "")) if p
        ),
    }
    children = [
        subprocess.Popen(
            [sys.executable, "-m", "benchmarks.form_processes", spec_file.name, str(i)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            env=env,
            start_new_session=True,
        )
        for i in range(processes)
    ]
    try:
        for child in children:
            if child.stdout.readline().strip() != "ready":  # type: ignore[union-attr]
                return None, "a child failed to create its handlers"
        mark("go")
        go = time.time()
        for child in children:
            child.stdin.write("go\n")  # type: ignore[union-attr]
            child.stdin.flush()  # type: ignore[union-attr]
        results: dict[str, Any] = {}
        for child in children:
            line = child.stdout.readline()  # type: ignore[union-attr]
            results.update(json.loads(line) if line.strip() else {})
        mark("returned")
        time.sleep(SETTLE_S)
        mark("settled")
        for child in children:
            with contextlib.suppress(OSError):
                child.stdin.write("exit\n")  # type: ignore[union-attr]
                child.stdin.flush()  # type: ignore[union-attr]
        errors = sorted({r["error"] for r in results.values() if "error" in r})
        done = [r for r in results.values() if "t" in r]
        if len(done) != size:
            return None, f"{len(done)}/{size} joined; errors: {errors[:3]}"
        ranks = sorted(r["rank"] for r in done)
        if ranks != list(range(size)):
            return None, f"ranks {ranks} are not 0..{size - 1}"
        return round(max(r["t"] for r in done) - go, 3), None
    finally:
        for child in children:
            with contextlib.suppress(subprocess.TimeoutExpired):
                child.wait(15)
            if child.poll() is None:
                child.kill()
                child.wait()
        Path(spec_file.name).unlink(missing_ok=True)


if __name__ == "__main__":
    sys.exit(_child(sys.argv[1], int(sys.argv[2])))
