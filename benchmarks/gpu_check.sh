#!/usr/bin/env bash
# kfp-elastic GPU verification (one NVIDIA GPU). Run from the repo root:  OUT=/some/dir bash gpu_check.sh
# Env knobs: SKIP_INSTALL=1 (use the current python), DEVICE=cpu (dry run, no GPU), ONLY=steps,
#            RUN_1B_MICRO=1 (the project's own 1B benchmark, ~5 min), RUN_E2E_TESTS=1 (pytest e2e on GPU).
set -u
OUT=${OUT:-/tmp/gpu-out}; mkdir -p "$OUT"; DEVICE=${DEVICE:-cuda}
exec > >(tee -a "$OUT/gpu_check.log") 2>&1
T0=$(date +%s); S=$(mktemp -d)
step() { echo; echo "=== [$(( $(date +%s) - T0 ))s] $*"; }
# ONLY="name ..." runs just those steps (e.g. ONLY="e2e_multi e2e_single").
run() { local t=$1 name=$2; shift 2; case " ${ONLY:-$name} " in *" $name "*) ;; *) return 0;; esac; step "$name"; timeout -k 10 "$t" "$@" > "$OUT/$name.txt" 2>&1; local rc=$?
  tail -n 60 "$OUT/$name.txt"; echo "--- $name rc=$rc"; echo "$name rc=$rc" >> "$OUT/rcs.txt"; }
export PYTHONPATH=${PYTHONPATH:+$PYTHONPATH:}$PWD OMP_NUM_THREADS=${OMP_NUM_THREADS:-4}
PY=python3
if [ -z "${SKIP_INSTALL:-}" ]; then
  step "install torch==2.13.0 and the project"
  python3 -m venv /tmp/gpuvenv && PY=/tmp/gpuvenv/bin/python
  $PY -m pip install -q -U pip && $PY -m pip install -q torch==2.13.0 && $PY -m pip install -q -e '.[test]' \
    || { echo "INSTALL FAILED"; exit 1; }
else PY=${PY:-$(command -v python3)}; fi
step "environment"
nvidia-smi -L; nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
$PY -c "import torch,sys;print(sys.version.split()[0],torch.__version__,'cuda',torch.version.cuda,'avail',torch.cuda.is_available(),'n',torch.cuda.device_count(),'nccl',torch.cuda.nccl.version() if torch.cuda.is_available() else '-')"
cat > "$S/gpu_probes.py" <<'PYEOF'
"""Focused GPU probes of kfp-elastic's claims (run from the repo root). PASS/FAIL/INFO lines.

  fork     the zygote's preload (DEFAULT_PRELOAD) must leave CUDA untouched so that a forked
           worker can use the GPU; and what happens when the parent called
           torch.cuda.is_available() first (torchrun --nproc-per-node=gpu|auto does, in the agent,
           before the zygote is forked from it) -- with and without PYTORCH_NVML_BASED_CUDA_CHECK.
  nccl     place_this_process/init_process_group (NCCL, world 1), object collectives, a CUDA
           state through Snapshotter (pinned D2H) and back, then the real StallAbort ->
           abort_process_group() path after SIGTERM, and CUDA still usable for a rescue after it.
  big      benchmarks/billion_params on the GPU: the time a snapshot adds to the step after it
           (the D2H copies overlap its forward/backward; CUDA synchronised before every clock
           read) against torch.save of the same state, pinned buffer size, host RSS.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
import textwrap
import time

FORK_CHILD = textwrap.dedent(
    """
    import os, sys
    nvml = sys.argv[1] == "nvml"
    if nvml:
        os.environ["PYTORCH_NVML_BASED_CUDA_CHECK"] = "1"
    from kfp_elastic.rendezvous.zygote import DEFAULT_PRELOAD, preload
    import torch
    if sys.argv[2] == "poison":
        print("parent torch.cuda.is_available() ->", torch.cuda.is_available())
    preload(list(DEFAULT_PRELOAD))
    maps = open("/proc/self/maps").read()
    print("parent: cuda initialized=%s libcuda mapped=%s" % (torch.cuda.is_initialized(), "libcuda" in maps))
    pid = os.fork()
    if pid == 0:
        try:
            x = torch.ones(4, device="cuda") * 2
            print("child: CUDA ok", x.sum().item(), flush=True)
            os._exit(0)
        except BaseException as error:
            print("child: CUDA FAILED", repr(error)[:300], flush=True)
            os._exit(3)
    _, status = os.waitpid(pid, 0)
    sys.exit(os.waitstatus_to_exitcode(status))
    """
)


def fork_probe() -> None:
    for nvml, mode, expect in (
        ("plain", "clean", "must work (the project's claim)"),
        ("plain", "poison", "torchrun nproc=gpu|auto path"),
        ("nvml", "poison", "same with PYTORCH_NVML_BASED_CUDA_CHECK=1"),
    ):
        try:
            run = subprocess.run(
                [sys.executable, "-c", FORK_CHILD, nvml, mode],
                capture_output=True, text=True, timeout=120,
            )
            out, rc = (run.stdout + run.stderr).strip().splitlines(), run.returncode
        except subprocess.TimeoutExpired:
            out, rc = ["TIMEOUT"], -1
        tag = "PASS" if rc == 0 else ("FAIL" if mode == "clean" else "INFO")
        print(f"{tag} fork[{nvml},{mode}] rc={rc} ({expect}):", *[l for l in out if "parent" in l or "child" in l], sep="\n    ")


def nccl_probe() -> None:
    import torch
    import torch.distributed as dist

    from kfp_elastic.worker import device as dev
    from kfp_elastic.worker.collective import shared
    from kfp_elastic.worker.snapshot import Snapshotter, read_state

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(29400 + os.getpid() % 1000),
                      RANK="0", WORLD_SIZE="1", LOCAL_RANK="0")
    placement = dev.place_this_process("auto")
    dev.init_process_group(placement, 60)
    print("INFO placement", placement, "TORCH_NCCL_ASYNC_ERROR_HANDLING=",
          os.environ.get("TORCH_NCCL_ASYNC_ERROR_HANDLING"), "nccl", torch.cuda.nccl.version()
          if placement.backend == "nccl" else "-")
    ok = placement.backend == "nccl" and placement.device == torch.device("cuda", 0)
    print(("PASS" if ok else "FAIL"), "auto device -> cuda:0/nccl")
    t = torch.ones(3, device=placement.device)
    dist.all_reduce(t)
    print(("PASS" if shared({"k": 1}) == {"k": 1} else "FAIL"), "broadcast_object_list on", placement.backend)
    model = torch.nn.Linear(512, 512).to(placement.device)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    model(torch.randn(8, 512, device=placement.device)).sum().backward()
    opt.step()
    state = {"model": model.state_dict(), "optimizer": opt.state_dict(), "step": 1}
    if torch.cuda.is_available():
        state["cuda_rng"] = torch.cuda.get_rng_state()
    tmp = tempfile.mkdtemp()
    snaps = Snapshotter(tmp)
    snaps.save(1, state, lambda name: None, wait=True)
    back = read_state(os.path.join(tmp, "snapshot-000000001.pt"))
    same = torch.equal(back["model"]["weight"], model.weight.detach().cpu()) and torch.equal(
        back["optimizer"]["state"][0]["momentum_buffer"], opt.state[model.weight]["momentum_buffer"].cpu())
    print(("PASS" if same else "FAIL"), "CUDA state -> pinned D2H snapshot -> file -> same bytes;",
          "buffer pinned:", getattr(snaps.buffer.data, "is_pinned", lambda: None)())
    # the real abort path: SIGTERM, no progress for grace_s, StallAbort calls abort_process_group
    signal.signal(signal.SIGTERM, lambda *_: None)
    stall = dev.StallAbort(0.5, dev.abort_process_group)
    os.kill(os.getpid(), signal.SIGTERM)
    deadline = time.monotonic() + 20
    while not stall.aborted and time.monotonic() < deadline:
        time.sleep(0.1)
    time.sleep(1.0)
    print(("PASS" if stall.aborted and not dist.is_initialized() else "FAIL"),
          f"StallAbort -> abort_process_group(): aborted={stall.aborted} is_initialized={dist.is_initialized()}")
    try:
        dev.settle(placement.device, stall)
        print("FAIL settle() after abort did not raise")
    except dev.CollectiveAborted:
        print("PASS settle() raises CollectiveAborted after the abort")
    stall.close()
    try:  # the rescue after an abort: D2H from device memory must still work
        from kfp_elastic.worker.rescue import Rescues
        path = Rescues(tmp, "probe").write(2, 0, {**state, "step": 2})
        print("PASS rescue written after abort:", path)
    except Exception as error:  # noqa: BLE001
        print("FAIL rescue after abort:", repr(error)[:300])


def big_probe() -> None:
    import resource

    import torch

    from kfp_elastic.worker.snapshot import Snapshotter
    from benchmarks import billion_params as bp

    model = bp.model().cuda()
    opt = bp.optimizer(model.parameters())
    x, y = (t[:32].cuda() for t in bp.dataset("train")[:32])
    for _ in range(2):
        bp.loss(model, [x, y]).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    torch.cuda.synchronize()
    n = sum(p.numel() for p in model.parameters())
    snaps = Snapshotter(tempfile.mkdtemp(dir=os.environ.get("BIG_DIR", "/tmp")))
    snaps.guard(opt)  # as the runtime: the next optimizer.step() waits for the copies

    def step() -> None:
        bp.loss(model, [x, y]).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    alone = []
    for _ in range(3):
        torch.cuda.synchronize()
        began = time.perf_counter()
        step()
        torch.cuda.synchronize()
        alone.append(time.perf_counter() - began)
    step_s = sorted(alone)[1]
    blocked_s = []
    for i in range(3):
        torch.cuda.synchronize()  # every clock read below waits for the GPU first
        began = time.perf_counter()
        snaps.save(i, {"model": model.state_dict(), "optimizer": opt.state_dict(), "step": i},
                   lambda name: None)
        call = time.perf_counter() - began
        step()  # its optimizer.step() waits for the parameters' copies (side stream)
        torch.cuda.synchronize()
        blocked = time.perf_counter() - began - step_s
        blocked_s.append(blocked)
        w0 = time.perf_counter()
        snaps.wait()
        print(f"INFO 1B params={n/1e9:.2f}G snapshot blocked the step {blocked:.3f}s "
              f"(step with it - step alone {step_s:.3f}s; save() call {call:.3f}s), background "
              f"write {time.perf_counter()-w0:.1f}s, pinned buffer "
              f"{snaps.buffer.nbytes/2**30:.1f} GiB, maxrss {resource.getrusage(resource.RUSAGE_SELF).ru_maxrss/2**20:.1f} GiB")
    torch.cuda.synchronize()
    began = time.perf_counter()
    torch.save({"model": model.state_dict(), "optimizer": opt.state_dict(), "step": 9},
               os.path.join(snaps.persist_dir, "torch_save.pt"))
    saved_s = time.perf_counter() - began
    print(f"INFO 1B torch.save of the same state (GPU tensors -> file) {saved_s:.2f}s")
    worst = max(blocked_s[1:])  # the first pins the buffer
    verdict = "PASS" if worst <= 0.2 and worst <= 0.1 * saved_s else "FAIL"
    print(f"{verdict} 1B snapshot blocking {worst:.3f}s (goal <= 0.2 s and <= 0.1 x torch.save "
          f"= {0.1 * saved_s:.2f}s)")
    print("INFO GPU max allocated %.1f GiB" % (torch.cuda.max_memory_allocated() / 2**30))


if __name__ == "__main__":
    {"fork": fork_probe, "nccl": nccl_probe, "big": big_probe}[sys.argv[1]]()
PYEOF
cat > "$S/gpu_e2e.py" <<'PYEOF'
"""GPU end-to-end checks for kfp-elastic (run from the repo root; OUT=<dir>).

  python gpu_e2e.py single DEVICE   1 node, nproc 1: SIGKILL the worker process mid-training;
                                    torchrun restarts it (warm start: forked by the zygote),
                                    it restores from the committed snapshot and finishes.
  python gpu_e2e.py multi DEVICE    3 nodes (nnodes 2:3) that SHARE one GPU (NCCL refuses two
                                    ranks on one GPU, so each node gets its own NCCL_HOSTID and
                                    sockets on lo: NCCL then treats them as 3 hosts); SIGKILL
                                    rank 0's node mid-epoch: survivors must leave the NCCL
                                    collective (StallAbort / watchdog), write rescues, re-form
                                    world 2 and finish.
Both check exactly-once (testing/model_defs/counting: every count == EPOCHS) and print PASS/FAIL.
DEVICE: cuda (GPU machine) or cpu (to dry-run this script without a GPU).
"""

from __future__ import annotations

import json
import os
import re
import signal
import sys
import time
from pathlib import Path

import torch

from kfp_elastic.etcd.embedded import EmbeddedEtcd
from kfp_elastic.testing.nodes import AgentGroup, new_run_id

MODE, DEVICE = sys.argv[1], sys.argv[2]
OUT = Path(os.environ.get("OUT", "/tmp/gpu-out")) / f"e2e-{MODE}"
OUT.mkdir(parents=True, exist_ok=True)
EPOCHS, SAMPLES = 3, 480


def events(path: Path) -> list[dict]:
    try:
        return [json.loads(x) for x in path.read_text().splitlines() if x.strip()]
    except (OSError, ValueError):
        return []


def wait_for(cond, timeout: float, what: str):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = cond()
        if value:
            return value
        time.sleep(0.1)
    raise TimeoutError(what)


def main() -> int:
    steps = OUT / "steps.jsonl"
    run_id = new_run_id(f"gpu-{MODE}")
    nodes = 1 if MODE == "single" else 3
    args = [
        "kfp_elastic.worker",
        *("--model-def", "benchmarks.timed_model_def"),
        *("--epochs", str(EPOCHS), "--batch-size", "4", "--step-time", "0.05"),
        *("--snapshot-every", "10" if MODE == "single" else "1000"),
        *("--snapshot-dir", str(OUT / "snap"), "--output", str(OUT / "model.pt")),
        *("--device", DEVICE),
    ]
    base_env = {
        "COUNTING_SAMPLES": str(SAMPLES),
        "TIMED_MODEL_DEF": "kfp_elastic.testing.model_defs.counting",
        "TIMED_STEPS_FILE": str(steps),
        "NCCL_DEBUG": "WARN",
    }
    ok = True
    with EmbeddedEtcd(data_dir=OUT / "etcd", log_file=OUT / "etcd.log") as etcd:
        args += ["--etcd", etcd.endpoint]
        with AgentGroup(OUT / "logs") as group:
            agents = []
            for i in range(nodes):
                env = dict(base_env)
                if MODE == "multi" and DEVICE == "cuda":
                    # 3 "hosts" on one GPU: NCCL's duplicate-GPU check compares host hashes.
                    env |= {
                        "NCCL_HOSTID": f"gpu-check-node{i}",
                        "NCCL_SOCKET_IFNAME": "lo",
                        "NCCL_IB_DISABLE": "1",
                        "CUDA_VISIBLE_DEVICES": os.environ.get("CUDA_VISIBLE_DEVICES", "0"),
                    }
                agents.append(
                    group.start(
                        backend="elastic-etcd",
                        endpoint=etcd.endpoint,
                        run_id=run_id,
                        nnodes="1:1" if nodes == 1 else "2:3",
                        script="-m",
                        script_args=args,
                        rdzv_conf={"last_call_timeout": 1},
                        name=f"node{i}",
                        env=env,
                    )
                )
                time.sleep(0.3)
            t0 = time.time()
            first = wait_for(
                lambda: [e for e in events(steps) if e["world"] == nodes and e["step"] >= 1],
                90,
                f"first step of world {nodes}",
            )
            print(f"first step after {first[0]['t'] - t0:.1f}s (incl. CUDA/NCCL init)")
            kill_step = 35 if MODE == "single" else 8
            wait_for(
                lambda: any(e["step"] >= kill_step for e in events(steps)),
                120,
                f"step {kill_step}",
            )
            if MODE == "single":
                victim_pid = max(events(steps), key=lambda e: e["t"])["pid"]  # the worker
                os.kill(victim_pid, signal.SIGKILL)
                killed_at = time.time()
                print(f"SIGKILLed worker pid={victim_pid} (agent + zygote live on)")
                survivors = agents
            else:
                victim = next(a for a in agents if "restored rank=0 world=3 " in a.log_text())
                killed_at = victim.sigkill_tree()
                print(f"SIGKILLed the whole node {victim.name} (rank 0)")
                survivors = [a for a in agents if a is not victim]
            codes = [a.wait(100) for a in survivors]
            after = [e for e in events(steps) if e["t"] > killed_at]
            if after:
                print(f"first step after the kill: {min(e['t'] for e in after) - killed_at:.1f}s")
            text = "\n".join(a.log_text() for a in group.agents)
    (OUT / "all_logs.txt").write_text(text)

    def check(name: str, good: bool, detail: str = "") -> None:
        nonlocal ok
        ok &= bool(good)
        print(f"{'PASS' if good else 'FAIL'} {MODE}: {name} {detail}")

    check("agents exit 0", codes == [0] * len(codes), str(codes))
    placed = sorted(set(re.findall(r"placed rank=\S+ local_rank=\S+ device=(\S+) backend=(\S+)", text)))
    want = ("cuda:0", "nccl") if DEVICE == "cuda" else ("cpu", "gloo")
    check("device/backend", placed == [want], str(placed))
    restored = re.findall(r"restored rank=0 world=(\d+) step=(\d+) .*from=(.*)", text)
    check("restored after the kill", len(restored) >= 2, str(restored))
    if MODE == "multi":
        rescued = re.findall(r"rescued rank=\d+ step=\d+", text)
        aborted = re.findall(r"aborting process group.*", text)
        check("survivors wrote rescues", bool(rescued), str(rescued[:3]))
        check("restored from a rescue", any("rescue" in r[2] for r in restored), "")
        print("abort lines:", aborted[:3])
    nccl = [ln for ln in text.splitlines() if re.search(r"NCCL|Watchdog|Duplicate GPU|CUDA error|initialization error|bad fork", ln)]
    print("NCCL/CUDA lines:", *nccl[:25], sep="\n  ")
    warm = len(re.findall(r"forked worker pid=", text))
    print(f"zygote forks seen in logs: {warm}")
    try:
        counts = torch.load(OUT / "model.pt")["counts"]
        good = torch.equal(counts, torch.full((SAMPLES,), float(EPOCHS), dtype=torch.float64))
        check("exactly-once counts", good, f"min={counts.min().item()} max={counts.max().item()}")
    except Exception as error:  # noqa: BLE001
        check("exactly-once counts", False, repr(error))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
PYEOF
# 1. zygote fork safety: preload like the zygote, fork, use CUDA in the child (+ torchrun nproc=gpu/auto poisoning)
run 90 fork_probe $PY "$S/gpu_probes.py" fork
# 2. NCCL placement, pinned D2H snapshot round trip, real StallAbort -> _abort_process_group, rescue after abort
run 60 nccl_probe $PY "$S/gpu_probes.py" nccl
[ "$DEVICE" = cuda ] && run 150 big_probe $PY "$S/gpu_probes.py" big
# 3. e2e, 1 node nproc 1: SIGKILL the worker mid-training; zygote re-forks it; restore from snapshot; exactly-once
run 150 e2e_single $PY "$S/gpu_e2e.py" single "$DEVICE"
# 4. e2e, 3 nodes sharing the GPU (NCCL_HOSTID trick; NCCL refuses 2 ranks/GPU otherwise): SIGKILL rank 0's node
run 180 e2e_multi $PY "$S/gpu_e2e.py" multi "$DEVICE"
# 5. benchmarks/billion_params on the GPU: blocking time of Snapshotter.save, pinned buffer, RSS
# 6. the project's snapshot micro-benchmark on the GPU (small model: pinned D2H path, timings)
run 90 micro_wide $PY -m benchmarks runtime --parts micro --model wide --device "$DEVICE" \
  --micro-n 20 --out "$OUT/micro_wide_$DEVICE.json"
# 7. the project's device/snapshot unit tests, now on a CUDA build of torch
run 90 unit_tests $PY -m pytest -q -p no:cacheprovider --noconftest tests/unit/worker/test_device.py \
  tests/unit/worker/test_snapshot_format.py tests/unit/worker/test_train_step.py \
  tests/unit/worker/test_host_copy.py
[ -n "${RUN_1B_MICRO:-}" ] && run 420 micro_1b $PY -m benchmarks runtime --parts micro --model 1b \
  --device cuda --micro-n 10 --out "$OUT/micro_1b.json"
[ -n "${RUN_E2E_TESTS:-}" ] && run 300 e2e_tests $PY -m pytest -x -q -p no:cacheprovider tests/e2e/test_rescue.py
step "summary"
grep -h -E '^(PASS|FAIL|INFO)' "$OUT"/*.txt | tee "$OUT/summary.txt"; cat "$OUT/rcs.txt"
echo "total $(( $(date +%s) - T0 ))s"
