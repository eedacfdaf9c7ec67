"""Several models on one machine (issue 34): how the machine's workers, CPUs and memory are split between them.

`tokenline serve --model chat=tiny --model summarize=/models/smol` serves both from one port, each model on
workers of its own. The split is a pure function of the machine's readings and the operator's asks, as
`plan_workers` is for one model:
- workers: a model given its own count (`--model-workers NAME=N`) gets it; the others share, evenly, what the
  machine plan (or `--workers`, the total) leaves, at least one each — so one model's flood can never take
  another's workers;
- CPUs: pinning (when asked) hands out the machine's CPU sets in the models' order;
- KV: every worker process (and each model's standby) gets the same share of the memory left (after each
  worker's footprint and its model's LoRA slots), as with one
  model, capped by what its own model's `max_seqs` sequences of `max_model_len` tokens can use (a small model
  needs less KV per token than a large one).
"""

from __future__ import annotations

from dataclasses import dataclass

from tokenline.engine.config import MiB
from tokenline.engine.machine import (FRONTEND_RESERVE_BYTES, KV_MEMORY_SHARE, MIN_KV_BYTES, WORKER_FOOTPRINT_BYTES,
                                      Machine, WorkerPlan, _size, plan_workers)


@dataclass(frozen=True)
class ModelAsk:
    """What the operator asked for one model."""

    name: str
    kv_bytes_per_token: int | None = None  # its KV per token (None: not known; no cap)
    workers: int | None = None  # its own worker count (None: a share of the rest)
    extra_bytes: int = 0  # what each of its workers holds beyond the footprint and KV (its LoRA slots)


def plan_models(machine: Machine, asks: list[ModelAsk], *, workers: int | None = None, threads: int | None = None,
                kv_cache_bytes: int | None = None, standby: int = 0, max_seqs: int = 64, max_model_len: int = 4096,
                pin: bool = False) -> list[WorkerPlan]:
    """One plan per model, in the order asked. `workers`: the total for the models without a count of their
    own (default: the machine's); `standby`: extra workers per model."""
    if not asks:
        raise ValueError("at least one model is needed")
    names = [a.name for a in asks]
    if len(set(names)) != len(names):
        raise ValueError(f"two models have the same name: {', '.join(sorted({n for n in names if names.count(n) > 1}))}"
                         " (name them: --model NAME=MODEL)")
    for a in asks:
        if a.workers is not None and a.workers < 1:
            raise ValueError(f"model {a.name!r}: workers must be at least 1, got {a.workers}")
    if len(asks) == 1:
        a = asks[0]
        return [plan_workers(machine, workers=a.workers if a.workers is not None else workers, threads=threads,
                             kv_cache_bytes=kv_cache_bytes, standby=standby, kv_bytes_per_token=a.kv_bytes_per_token,
                             max_seqs=max_seqs, max_model_len=max_model_len, pin=pin, extra_bytes=a.extra_bytes)]
    counts = _split_workers(machine, asks, workers, threads, standby * len(asks))
    whole = plan_workers(machine, workers=sum(counts), threads=threads, kv_cache_bytes=kv_cache_bytes,
                         standby=standby * len(asks), max_seqs=max_seqs, max_model_len=max_model_len, pin=pin)
    processes = sum(counts) + standby * len(asks)
    left = (machine.available_bytes - FRONTEND_RESERVE_BYTES - processes * WORKER_FOOTPRINT_BYTES
            - sum(a.extra_bytes * (n + standby) for a, n in zip(asks, counts)))
    each = int(KV_MEMORY_SHARE * max(left, 0) / processes)
    plans, first = [], 0
    for a, n in zip(asks, counts):
        kv = kv_cache_bytes
        if kv is None:
            kv = each if not a.kv_bytes_per_token else min(each, a.kv_bytes_per_token * max_seqs * max_model_len)
            kv = max(kv // MiB * MiB, MIN_KV_BYTES)
        share = kv * (n + standby) / max(machine.available_bytes, 1)
        plans.append(WorkerPlan(n, whole.threads, kv, machine, share, whole.cpu_sets[first:first + n]))
        first += n
    return plans


def _split_workers(machine: Machine, asks: list[ModelAsk], total: int | None, threads: int | None,
                   standby: int) -> list[int]:
    """Each model's workers: its own count, or an even share (at least one) of what the others leave."""
    own = sum(a.workers for a in asks if a.workers is not None)
    shared = [i for i, a in enumerate(asks) if a.workers is None]
    if not shared:
        return [a.workers for a in asks]  # type: ignore[misc]
    if total is None:
        total = plan_workers(machine, threads=threads, standby=standby).workers
    left = max(total - own, len(shared))
    counts = [a.workers or 0 for a in asks]
    for k, i in enumerate(shared):
        counts[i] = left // len(shared) + (1 if k < left % len(shared) else 0)
    return counts


def describe_models(names: list[str], plans: list[WorkerPlan]) -> str:
    """The start-up line's plan for several models: each one's workers and KV, then the machine."""
    parts = []
    for name, p in zip(names, plans):
        w = f"{p.workers} worker{'s' if p.workers != 1 else ''}"
        t = f"{p.threads} thread{'s' if p.threads != 1 else ''}"
        parts.append(f"{name}: {w} × {t}, KV {_size(p.kv_cache_bytes)} each")
    m = plans[0].machine
    share = sum(p.kv_share for p in plans)
    gpus = f", {m.gpus} GPUs" if m.gpus else ""
    return (f"{len(plans)} models — {'; '.join(parts)} ({100 * share:.0f} % of available memory for KV; {m.cpus} CPUs"
            f"{gpus}, {_size(m.available_bytes)} available)")
