"""The machine a server runs on, and the defaults it gives: workers, threads per worker, KV cache per worker.

`read_machine()` reads, once at start-up, the CPUs this process may use (its affinity, cut by the
cgroup's cpu.max quota), the memory actually available (MemAvailable, cut by the cgroup's
memory.max) and the GPUs visible. `plan_workers()` is a pure function of those readings and the
operator's flags, so tests can hand it any machine.

The rules, measured on the 2-core CPU boxes (see README, "Sizing from the machine"):
- CPU: one worker per usable CPU, one OpenMP thread each. Two 1-thread workers out-serve one
  2-thread engine at saturation, and a 1-thread worker's step does not swing when another process
  wants a core.
- CPU pinning, only when asked (`pin`): when the workers' threads fill the usable CPUs exactly, each
  worker gets CPUs of its own (`cpu_sets`; the supervisor binds a worker once it is ready). Measured
  on a 2-core AMX box, default model, 64 requests at once, fresh servers taking turns: 639 against
  613 output tok/s (mean of 6 each; decode steps of 32 sequences 68-71 against 70-84 ms). Not the
  default: on that box (Linux 6.18, autogroup on) two pinned busy workers starved processes of other
  sessions, a client on the same machine among them, for 0.6-6.7 s at a time (a 10 ms sleep loop woke
  that late in each of three runs), never with the workers unpinned (three runs) or with autogroup off (two).
- GPU: one worker per GPU.
- KV cache: a share of the memory left once the frontend, every worker's own footprint (weights,
  activations, the Python runtime) and the OS are set aside, split between workers and never more
  than `max_seqs` sequences of `max_model_len` tokens can use.
"""

from __future__ import annotations

import math
import os
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

from tokenline.engine import modelconfig
from tokenline.engine.config import MiB

GiB = 1 << 30

FRONTEND_RESERVE_BYTES = 1 * GiB  # the gRPC frontend, tokenizers, the OS's own slack
WORKER_FOOTPRINT_BYTES = 2 * GiB  # one in-process vLLM engine without its KV cache (measured ~1.7 GiB)
KV_MEMORY_SHARE = 0.5  # of what is left: the rest stays free for the page cache and anything else
MIN_KV_BYTES = 64 * MiB


@dataclass(frozen=True)
class Machine:
    """What this process may use."""

    cpus: int  # usable CPUs: affinity, cut by the cgroup quota (at least 1)
    available_bytes: int  # memory available to new processes
    gpus: int = 0
    cpu_ids: tuple[int, ...] = ()  # the CPUs of this process's affinity, ascending (empty: not known)


@dataclass(frozen=True)
class WorkerPlan:
    """How a model is run on this machine, and why."""

    workers: int
    threads: int  # OpenMP threads per worker
    kv_cache_bytes: int  # per worker
    machine: Machine
    kv_share: float  # all workers' KV ÷ available memory
    # The CPUs each worker is bound to, one set per worker (empty: the OS places them; see pin_sets).
    cpu_sets: tuple[tuple[int, ...], ...] = ()

    def describe(self) -> str:
        """The start-up line: '2 workers × 1 thread (pinned to CPUs 0 | 1), KV 4.5 GiB each (40 % of available
        memory; 2 CPUs, 22.4 GiB available)'."""
        w = f"{self.workers} worker{'s' if self.workers != 1 else ''}"
        t = f"{self.threads} thread{'s' if self.threads != 1 else ''}"
        pinned = f" (pinned to CPUs {' | '.join(cpu_list_text(s) for s in self.cpu_sets)})" if self.cpu_sets else ""
        gpus = f", {self.machine.gpus} GPUs" if self.machine.gpus else ""
        return (f"{w} × {t}{pinned}, KV {_size(self.kv_cache_bytes)} each ({100 * self.kv_share:.0f} % of available "
                f"memory; {self.machine.cpus} CPUs{gpus}, {_size(self.machine.available_bytes)} available)")


def plan_workers(machine: Machine, *, workers: int | None = None, threads: int | None = None,
                 kv_cache_bytes: int | None = None, standby: int = 0,
                 kv_bytes_per_token: int | None = None, max_seqs: int = 64, max_model_len: int = 4096,
                 pin: bool = False, extra_bytes: int = 0) -> WorkerPlan:
    """Workers, threads and KV per worker: what the operator gave, the rest from the machine.
    `pin`: bind workers to CPUs of their own where pin_sets finds them (else the OS places them).
    `extra_bytes`: what each worker holds beyond its footprint and KV (LoRA slots, engine/lora.py slot_bytes)."""
    for name, value in (("workers", workers), ("threads", threads), ("kv_cache_bytes", kv_cache_bytes)):
        if value is not None and value < 1:
            raise ValueError(f"{name} must be at least 1, got {value}")
    if threads is None:
        # One thread even when fewer workers than CPUs are asked for: a multi-threaded engine's steps
        # stall whenever anything else wants one of its cores (measured: 3× slower on a busy box).
        threads = 1
    if workers is None:
        if machine.gpus:
            workers = machine.gpus
        else:
            by_cpu = max(1, machine.cpus // threads)
            # Never so many that each worker's own footprint and a minimal KV cache no longer fit.
            room = machine.available_bytes - FRONTEND_RESERVE_BYTES
            by_memory = max(1, room // (WORKER_FOOTPRINT_BYTES + extra_bytes + MIN_KV_BYTES) - standby)
            workers = min(by_cpu, by_memory)
    if kv_cache_bytes is None:
        processes = workers + standby
        left = machine.available_bytes - FRONTEND_RESERVE_BYTES - processes * (WORKER_FOOTPRINT_BYTES + extra_bytes)
        kv_cache_bytes = int(KV_MEMORY_SHARE * max(left, 0) / processes)
        if kv_bytes_per_token:
            kv_cache_bytes = min(kv_cache_bytes, kv_bytes_per_token * max_seqs * max_model_len)
        kv_cache_bytes = max(kv_cache_bytes // MiB * MiB, MIN_KV_BYTES)
    share = kv_cache_bytes * (workers + standby) / max(machine.available_bytes, 1)
    return WorkerPlan(workers, threads, kv_cache_bytes, machine, share,
                      pin_sets(machine, workers, threads) if pin else ())


def pin_sets(machine: Machine, workers: int, threads: int) -> tuple[tuple[int, ...], ...]:
    """CPUs for each worker when `workers` × `threads` fill the machine's CPUs exactly; else none.

    Not on a GPU machine (the GPU does the work), not where the CPUs are unknown or a cgroup quota
    cuts them (a quota is time, not particular CPUs), and not when workers leave CPUs over (the OS then
    balances them against whatever else runs) or would share them."""
    ids = machine.cpu_ids
    if machine.gpus or not ids or len(ids) != machine.cpus or workers * threads != len(ids):
        return ()
    return tuple(ids[i * threads:(i + 1) * threads] for i in range(workers))


def pin_process(pid: int, cpus: Iterable[int]) -> bool:
    """Bind every thread of process `pid` to `cpus` (threads it starts later inherit it); False if it is gone."""
    cpus = set(cpus)
    try:
        tids = [int(t) for t in os.listdir(f"/proc/{pid}/task")]
    except (OSError, ValueError):
        tids = [pid]
    pinned = False
    for tid in tids:
        try:
            os.sched_setaffinity(tid, cpus)
            pinned = True
        except OSError:  # a thread that ended meanwhile; a process that is gone
            continue
    return pinned


def set_nice(pid: int, nice: int) -> bool:
    """Give every thread of process `pid` the CPU niceness `nice` (threads it starts later inherit it). False when
    not allowed (raising a priority back needs CAP_SYS_NICE, or an RLIMIT_NICE that allows it) or the process is gone."""
    try:
        tids = [int(t) for t in os.listdir(f"/proc/{pid}/task")]
    except (OSError, ValueError):
        tids = [pid]
    done = False
    for tid in tids:
        try:
            os.setpriority(os.PRIO_PROCESS, tid, nice)
            done = True
        except PermissionError:
            return False
        except OSError:  # a thread that ended meanwhile; a process that is gone
            continue
    return done


def read_machine() -> Machine:
    return Machine(cpus=usable_cpus(), available_bytes=available_memory(), gpus=visible_gpus(), cpu_ids=affinity())


def affinity() -> tuple[int, ...]:
    """The CPUs this process may run on, ascending; empty where the platform cannot say."""
    try:
        return tuple(sorted(os.sched_getaffinity(0)))
    except (AttributeError, OSError):
        return ()


def usable_cpus() -> int:
    """CPUs this process may run on, cut by a cgroup v2 CPU quota ("cpu.max": quota period)."""
    cpus = len(affinity()) or os.cpu_count() or 1
    quota = _cgroup_file("cpu.max")
    if quota:
        parts = quota.split()
        if len(parts) == 2 and parts[0] != "max":
            try:
                cpus = min(cpus, max(1, math.floor(int(parts[0]) / int(parts[1]))))
            except (ValueError, ZeroDivisionError):
                pass
    return max(cpus, 1)


def available_memory() -> int:
    """MemAvailable from /proc/meminfo, cut by what the cgroup's memory.max still allows and by what
    the NUMA nodes of this process's CPUs have (vLLM's CPU worker checks its KV cache against its
    node's memory, not the machine's, and refuses to start if it does not fit there)."""
    return min(_system_available_memory(), node_available_memory())


def node_available_memory(root: Path = Path("/sys/devices/system/node"), cpus: set[int] | None = None) -> int:
    """Memory available on the NUMA nodes holding `cpus` (default: this process's), counted as vLLM's
    CPU worker counts it (MemFree + file pages + reclaimable slab, vllm/utils/cpu_resource_utils.py).
    Seen on a 2-core VM: /proc/meminfo says 23.5 GiB, its one node 8.0 GiB; a worker planned 10 GiB
    of KV from the first failed to start. Large (no limit) where the kernel shows no nodes."""
    if cpus is None:
        cpus = set(affinity())
        if not cpus:
            return 1 << 62
    total, found = 0, False
    for node in sorted(root.glob("node[0-9]*")):
        try:
            node_cpus = _cpu_list(((node / "cpulist").read_text()))
            if not node_cpus & cpus:
                continue
            info = {}
            for line in (node / "meminfo").read_text().splitlines():
                parts = line.split()  # "Node 0 MemFree:   6114440 kB"
                if len(parts) >= 4:
                    info[parts[2].rstrip(":")] = int(parts[3]) * 1024
            total += sum(info.get(k, 0) for k in ("MemFree", "Active(file)", "Inactive(file)", "SReclaimable"))
            found = True
        except (OSError, ValueError):
            continue
    return total if found else 1 << 62


def cpu_list_text(cpus: Iterable[int]) -> str:
    """[0, 1, 2, 3, 8] -> '0-3,8' (the kernel's cpulist form)"""
    ids, parts = sorted(set(cpus)), []
    for cpu in ids:
        if parts and parts[-1][1] == cpu - 1:
            parts[-1][1] = cpu
        else:
            parts.append([cpu, cpu])
    return ",".join(str(lo) if lo == hi else f"{lo}-{hi}" for lo, hi in parts)


def _cpu_list(text: str) -> set[int]:
    """'0-3,8,10-11' -> {0, 1, 2, 3, 8, 10, 11}"""
    cpus: set[int] = set()
    for part in text.strip().split(","):
        if part:
            lo, _, hi = part.partition("-")
            cpus.update(range(int(lo), int(hi or lo) + 1))
    return cpus


def _system_available_memory() -> int:
    """MemAvailable from /proc/meminfo, cut by what the cgroup's memory.max still allows."""
    available = None
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                available = int(line.split()[1]) * 1024
                break
    except OSError:
        pass
    if available is None:
        try:
            available = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
        except (ValueError, OSError):
            available = 4 * GiB
    limit, current = _cgroup_file("memory.max"), _cgroup_file("memory.current")
    if limit and limit != "max" and limit.isdigit():
        used = int(current) if current and current.isdigit() else 0
        available = min(available, max(int(limit) - used, 0))
    return available


def visible_gpus() -> int:
    """NVIDIA GPUs this process may use: CUDA_VISIBLE_DEVICES when set, else the driver's list."""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is not None:
        return len([d for d in visible.split(",") if d.strip() and d.strip() != "-1"])
    try:
        return len(list(Path("/proc/driver/nvidia/gpus").iterdir()))
    except OSError:
        return 0


# CPU flags under which bf16 is the faster dtype: native bf16 (AMX, AVX-512 BF16), or AVX-512, where
# oneDNN runs bf16 matmuls. On AVX2 alone vLLM's oneDNN linear cannot be built for bf16 ("could not
# create a primitive descriptor for the matmul primitive") and falls back to torch's: measured on a
# 2-core AVX2 EPYC, the default model in-process served 6.7 output tok/s in bf16 against 33 in float32
# (32 requests of 256 + 64 tokens) and took 3.6 s against 0.66 s to its first token at concurrency 1.
BF16_FLAGS = ("amx_bf16", "avx512_bf16", "avx512f")


def cpu_flags() -> frozenset[str]:
    """The CPU's feature flags (/proc/cpuinfo), empty where they cannot be read."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return frozenset(line.partition(":")[2].split())
    except OSError:
        pass
    return frozenset()


def choose_dtype(requested: str, flags: frozenset[str] | None = None, *, gpus: int = 0) -> tuple[str, str]:
    """The dtype a worker runs in, and why: `requested` unless it is "auto"; then bf16 on a GPU or where
    the CPU computes bf16 fast (BF16_FLAGS), float32 on a CPU without them."""
    if requested != "auto":
        return requested, "as asked"
    if gpus:
        return "bfloat16", "GPU"
    flags = cpu_flags() if flags is None else flags
    fast = [f for f in BF16_FLAGS if f in flags]
    if fast:
        return "bfloat16", f"the CPU has {fast[0]}"
    return "float32", "no AVX-512 on this CPU: bf16 matmuls would take a slow path"


def kv_bytes_per_token(model_path: str | Path, dtype: str = "bfloat16") -> int | None:
    """KV cache bytes one token takes in this model (keys and values, every layer), from config.json."""
    return modelconfig.kv_bytes_per_token(modelconfig.read_config(model_path), dtype)


def _cgroup_file(name: str) -> str | None:
    """A file of this process's cgroup v2 directory, stripped; None if there is none."""
    try:
        for line in Path("/proc/self/cgroup").read_text().splitlines():
            if line.startswith("0::"):
                return (Path("/sys/fs/cgroup") / line[3:].lstrip("/") / name).read_text().strip()
    except OSError:
        return None
    return None


def _size(n: int) -> str:
    return f"{n / GiB:.1f} GiB" if n >= GiB else f"{n / MiB:.0f} MiB"
