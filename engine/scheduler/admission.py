"""Admission control: can a request be accepted, and when would it run?

Forecasts from each worker's measured step time (see pace.py), the queue
ahead and the rate at which the model has been finishing work. The Scheduler
holds one AdmissionControl, built over its state; it reads that state and
changes none of it (a model started on demand is the Scheduler's to create).
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Callable

from tokenline.engine.scheduler.budget import blocks_at_most
from tokenline.engine.scheduler.config import SchedulerConfig, model_name
from tokenline.engine.scheduler.records import Entry, Refusal, Refuse
from tokenline.engine.scheduler.state import ModelState, WorkerView
from tokenline.engine.types import TrafficClass


class AdmissionControl:
    """Estimates and refusals over the Scheduler's state, given explicitly."""

    def __init__(self, config: SchedulerConfig, models: dict[str, ModelState], workers: dict[int, WorkerView],
                 entries: dict[str, Entry], on_demand: dict[str, float], tenant_inflight: Counter[str],
                 tenant_queued_tokens: Counter[str], model_of: Callable[[str], ModelState],
                 tenant_model_inflight: Counter[tuple[str, str]] | None = None):
        self.config = config
        self.models = models
        self.workers = workers
        self.entries = entries
        self.on_demand = on_demand  # models whose workers start on demand -> seconds a start takes
        self.tenant_inflight = tenant_inflight  # queued + running requests per tenant
        self.tenant_queued_tokens = tenant_queued_tokens  # prompt + max new tokens queued per tenant
        self.model_of = model_of  # the model's state, created if new (a model started on demand)
        self.tenant_model_inflight = tenant_model_inflight if tenant_model_inflight is not None else Counter()

    def check(self, e: Entry, now: float) -> Refuse | None:
        if e.key in self.entries:
            return Refuse(e.key, Refusal.DUPLICATE, f"request id {e.key!r} is already in flight")
        model = self.models.get(e.model)
        if e.model in self.on_demand:  # a worker starts when work queues (the autoscaler's)
            model = self.model_of(e.model)
        elif model is None or not model.workers:
            return Refuse(e.key, Refusal.NO_WORKER, f"no worker is serving model {e.model!r} right now", 1.0)
        specs = [self.workers[w].spec for w in model.workers] or [s for s in (model.last_spec,) if s is not None]
        if specs and all(blocks_at_most(e, s.block_size) > s.kv_blocks_total - self.config.kv_watermark_blocks for s in specs):
            return Refuse(e.key, Refusal.TOO_LARGE, "prompt plus max_tokens needs more KV cache than a worker has; lower max_tokens or shorten the prompt")
        cls_cfg = self.config.for_class(e.cls)
        queue = model.queues[e.cls]
        if queue.requests + 1 > cls_cfg.max_queued_requests or queue.tokens + e.cost > cls_cfg.max_queued_tokens:
            excess = max(queue.tokens + e.cost - cls_cfg.max_queued_tokens, e.cost)
            return Refuse(e.key, Refusal.QUEUE_FULL, f"the {e.cls.name.lower()} queue for {e.model!r} is full ({queue.requests} requests, {queue.tokens} tokens)", self.retry_after(model, excess, now))
        tenant_cfg = self.config.for_tenant(e.tenant)
        inflight = self.tenant_inflight[e.tenant]
        if inflight + 1 > tenant_cfg.max_concurrent:
            return Refuse(e.key, Refusal.TENANT_LIMIT, f"tenant {e.tenant!r} has {inflight} requests in flight, its limit is {tenant_cfg.max_concurrent}", self.retry_after(model, e.cost, now))
        on_model = tenant_cfg.concurrent_on(model_name(e.model))
        if on_model is not None:
            held = self.tenant_model_inflight[e.tenant, model_name(e.model)]
            if held + 1 > on_model:
                return Refuse(e.key, Refusal.TENANT_LIMIT, f"tenant {e.tenant!r} has {held} requests in flight on model "
                              f"{model_name(e.model)!r}, its limit there is {on_model}", self.retry_after(model, e.cost, now))
        queued_tokens = self.tenant_queued_tokens[e.tenant]
        if queued_tokens + e.cost > tenant_cfg.max_queued_tokens:
            return Refuse(e.key, Refusal.TENANT_LIMIT, f"tenant {e.tenant!r} has {queued_tokens} tokens queued, its limit is {tenant_cfg.max_queued_tokens}", self.retry_after(model, e.cost, now))
        if e.deadline is not None:
            start = self.estimate_start(e, model, now)
            done = start + self.service_estimate(e.model, e)
            what = "its first token"
            if e.must_complete_by_deadline:
                done += max(e.max_tokens - 1, 0) * self.decode_step_estimate(e.model)
                what = f"all {e.max_tokens} tokens"
            if done > e.deadline:
                return Refuse(e.key, Refusal.DEADLINE, f"cannot produce {what} before the deadline: estimated at {1000 * (done - now):.0f} ms from now, deadline in {1000 * (e.deadline - now):.0f} ms")
        return None

    def predicted_misses(self, model_name: str, now: float) -> int:
        """Queued requests whose first token is estimated past their deadline (when a slot frees up,
        given what runs and what queues, plus time to first token). It counts the whole queue as
        ahead of each, so it errs early: what the autoscaler wants, adding a worker a little soon."""
        model = self.models.get(model_name)
        if model is None or not model.workers:
            return 0
        return sum(1 for queue in model.queues.values() if queue.with_deadline for e in queue
                   if e.deadline is not None
                   and self.estimate_start(e, model, now) + self.service_estimate(model_name, e) > e.deadline)

    def decode_step_estimate(self, model_name: str) -> float:
        model = self.models[model_name]
        if not model.workers:
            return self.config.step_time_prior_s
        w = self.workers[model.workers[0]]
        return w.pace.estimator.step_s(max(len(w.running), 1))

    def service_estimate(self, model_name: str, e: Entry) -> float:
        """Admission to first token on this model's typical worker."""
        model = self.models[model_name]
        if not model.workers:
            return self.config.step_time_prior_s
        w = self.workers[model.workers[0]]
        return w.pace.estimator.first_token_s(max(len(w.running), 1), e.prompt_tokens)

    def estimate_start(self, e: Entry, model: ModelState, now: float) -> float:
        """When a slot could be free for `e`, given what runs and what queues ahead of it."""
        free_at: list[float] = []
        for wid in model.workers:
            w = self.workers[wid]
            if w.accepting():
                # Free slots count only while using one keeps running requests' deadlines.
                usable = w.slots_free(e.cls) if self.keeps_deadlines(w, len(w.running) + 1, now, e.prompt_tokens) else 0
                free_at += [now] * usable
                free_at += sorted(x.est_finish for x in w.running.values())
            else:
                batch_end = max(x.est_finish for x in w.running.values())
                free_at += [batch_end] * w.spec.engine_seqs
        free_at.sort()
        ahead = len(model.queues[TrafficClass.INTERACTIVE])
        if e.cls == TrafficClass.BULK:
            ahead += len(model.queues[TrafficClass.BULK])
        if not free_at and not model.workers and e.model in self.on_demand:
            return now + self.on_demand[e.model]  # a worker is started for it
        if not free_at:
            return math.inf
        if ahead < len(free_at):
            start = free_at[ahead]
        else:
            # Past the slots we can see, each round of requests ahead takes a whole run
            # (first token plus its decode), not just a first token.
            rounds = ahead // len(free_at)
            run_s = self.service_estimate(e.model, e) + max(e.max_tokens - 1, 0) * self.decode_step_estimate(e.model)
            start = free_at[ahead % len(free_at)] + rounds * run_s
        # However many slots look free, the queue ahead drains no faster than the model has
        # been finishing work lately.
        rate = self.drain_rate(model, now)
        if rate > 0:
            queued = model.queues[TrafficClass.INTERACTIVE].tokens
            if e.cls == TrafficClass.BULK:
                queued += model.queues[TrafficClass.BULK].tokens
            start = max(start, now + queued / rate)
        return max(start, now)

    def drain_rate(self, model: ModelState, now: float) -> float:
        """Tokens (prompt + generated) the model finishes per second while it is full, over the drain window;
        0 (no evidence) until it has been full for a tenth of the window. A model that was mostly idle
        finished only what it was asked: that rate says nothing of how fast it drains a queue."""
        window = self.config.drain_window_s
        start = now - window
        while model.drained and model.drained[0][0] < start:
            model.drained.popleft()
        spans = list(model.full_spans)
        if model.no_capacity_since is not None:
            spans.append((model.no_capacity_since, now))
        full_s = sum(max(min(end, now) - max(begin, start), 0.0) for begin, end in spans)
        if full_s < 0.1 * window:
            return 0.0
        return sum(t for _, t in model.drained) / full_s

    def retry_after(self, model: ModelState, tokens: int, now: float) -> float:
        rate = self.drain_rate(model, now)
        if rate <= 0:
            return 1.0
        return min(max(tokens / rate, 0.01), 60.0)

    def keeps_deadlines(self, w: WorkerView, batch: int, now: float, prefill_tokens: int = 0) -> bool:
        """Would every running request that can meet its deadline still meet it after this admission?

        An admission makes every later step slower (a bigger batch) and adds its prompt to the
        prefill the worker still owes (steps are shared: running sequences wait for it too).
        Admitting past the point where that costs a running request its deadline would turn
        one that was going to finish into an expired one.
        """
        if not w.spec.continuous:
            return True
        per_token = w.pace.estimator.prefill_per_token_s
        owed = self.prefill_owed(w) * per_token
        current = w.pace.estimator.step_s(len(w.running))
        slower = w.pace.estimator.step_s(batch)
        added = prefill_tokens * per_token
        for r in w.running.values():
            if r.deadline is None:
                continue
            if now + owed + r.remaining * current <= r.deadline < now + owed + added + r.remaining * slower:
                return False
        return True

    def cannot_complete(self, e: Entry, w: WorkerView, now: float) -> bool:
        """For work that must finish by its deadline: would it miss it even if it started now?"""
        if not e.must_complete_by_deadline or e.deadline is None:
            return False
        est = w.pace.estimator
        finish = (now + (self.prefill_owed(w) + e.prompt_tokens + e.generated) * est.prefill_per_token_s
                  + e.remaining * est.step_s(len(w.running) + 1))
        return finish > e.deadline

    def first_token_at(self, e: Entry, w: WorkerView, now: float) -> tuple[float, int, int]:
        """When `e` would get its first token on `w` (its pace's forecast, with the prompts `w` still owes);
        ties (before any step was measured) go to the smaller batch, then to more free slots."""
        owed = self.prefill_owed(w) + e.prompt_tokens + e.generated
        return w.pace.first_token_at(now, len(w.running), owed), len(w.running), -w.slots_free()

    @staticmethod
    def prefill_owed(w: WorkerView) -> int:
        """Prompt tokens admitted to `w` that it has not computed yet (no token produced since admission), less what
        its prefix cache holds of a call's sample (Entry.prefill_tokens)."""
        return sum(e.prefill_tokens for e in w.running.values() if not e.prefilled)
