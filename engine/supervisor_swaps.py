"""Serve while compiling: compiled workers swap in one at a time, each retiring an eager one (engine/supervisor.py).

A model whose workers are to be compiled starts them eager (ready in seconds), then builds compiled workers one at
a time, each a swap-in: once it is ready it becomes active and an eager worker is retired (`on_retire(worker_id)`:
the caller gives it no new work), finishing its running sequences; once `busy()` no longer names it, it is reported
lost (it holds nothing) and stopped, not restarted, no crash. The next compiled worker is built once it has gone
(memory is planned for one extra worker). Part of the Supervisor (a mixin: it works on the supervisor's state).
"""

from __future__ import annotations

import logging
import os
import time

from tokenline.engine.machine import set_nice
from tokenline.engine.types import Shutdown, WorkerSpec

log = logging.getLogger("tokenline.runtime")

RETIRE_CHECK_S = 0.2  # how often retiring workers are looked at for being idle (a step report looks at once)
# The eager workers of a model beyond its first load at this CPU niceness, so that on a small machine the first one
# is not slowed by the others (they share the cores): the server serves as soon as one worker is ready.
LOADING_NICE = 10


class SwapIns:
    def _load_behind(self, wid: int) -> None:
        """An eager worker that is not its model's first loads LOADING_NICE below this process's CPU priority until
        it is ready."""
        handle = self.handles.get(wid)
        if not getattr(handle, "local", False) or handle.pid is None:
            return
        base = os.getpriority(os.PRIO_PROCESS, 0)
        if set_nice(handle.pid, min(base + LOADING_NICE, 19)):
            self._loading_behind[wid] = base

    def _full_priority(self, wid: int) -> None:
        """A worker that loaded behind the first is ready: back to this process's priority, where the OS allows it."""
        base = self._loading_behind.pop(wid, None)
        if base is not None and not set_nice(self.handles[wid].pid, base):
            log.info("worker %d keeps its lower CPU priority (raising it back is not allowed here) until a compiled "
                     "worker replaces it", wid)

    def _next_swap(self, model: str) -> None:
        """Build the next compiled worker of `model`, if one is due: once its workers are up, none is being
        built and the last one retired has gone; or say that every active worker is compiled."""
        if model not in self.swapping or self._closing or model in self.start_errors or model in self._swap_in:
            return
        if any(self._model_of.get(w) == model for w in (*self._retirees, *self._retiring)):
            return  # the worker last retired still holds its memory
        if model in self.compile_failed or not any(self._model_of.get(w) == model for w in self._eager):
            self.swapping.discard(model)
            if model not in self.compile_failed:
                log.warning("all active workers of model %s are compiled, %.1f s after start (%d swapped in)", model,
                            time.monotonic() - self._started_at, self.swaps[model])
            for _ in range(self.standby - sum(1 for w in self._standby_ids if self._model_of.get(w) == model)):
                self._spawn(model, self._config(model), standby=True)
            return
        if self.starting(model) or not any(w in self.specs for w in self._eager if self._model_of.get(w) == model):
            return  # serving first: an eager worker still loading comes before a compiled one
        wid = self._spawn(model, self.worker_configs[model][0])
        self._swap_in[model] = wid
        log.info("building compiled worker %d of model %s to take over from an eager one", wid, model)

    def _take_over(self, wid: int, spec: WorkerSpec) -> None:
        """A compiled worker is ready: it becomes active, and an eager worker (an idle one if any) retires."""
        model = spec.model
        del self._swap_in[model]
        busy = self.busy()
        eager = sorted((w for w in self._eager if w in self.specs and self._model_of.get(w) == model),
                       key=lambda w: (w in busy, w))
        if not eager:  # none left to replace (the autoscaler removed it): not needed
            log.info("compiled worker %d of model %s is not needed: no eager worker is left to replace", wid, model)
            self._retiring.add(wid)
            self.loop.run_in_executor(None, self.handles[wid].terminate, 10.0)
            return
        old = eager[0]
        self._eager.discard(old)
        self._retirees[old] = time.monotonic()
        self.specs.pop(old)  # out of the active set first, so that the compiled worker takes its CPUs
        self.cpu_set_of.pop(old, None)
        self.on_retire(old)
        self.compiled_active.add(model)
        self.swaps[model] += 1
        built = time.monotonic() - self._spawned_at.get(wid, time.monotonic())
        self._activate(wid, spec)
        log.warning("worker %d (compiled) took over from worker %d (eager) after %.1f s; worker %d takes no new work "
                    "and stops once its runs finish (%s)", wid, old, built, old,
                    "running some now" if old in busy else "idle now")
        self._stop_idle_retirees()

    def _stop_idle_retirees(self) -> None:
        """Stop each retiring worker that runs nothing any more: reported lost (it holds no runs), then stopped."""
        if self._retire_timer is not None:
            self._retire_timer.cancel()
            self._retire_timer = None
        if self._closing:
            return
        busy = self.busy()
        for wid in [w for w in self._retirees if w not in busy]:
            since = self._retirees.pop(wid)
            self._retiring.add(wid)
            self._retired.add(wid)
            self.on_lost(wid)
            kind = ("old version" if self._model_of.get(wid) in self.retired_models
                    else "given back" if wid in self.given_back else "eager")
            self.given_back.discard(wid)
            log.info("worker %d (%s) retired: stopped %.1f s after it was replaced, its runs finished", wid, kind,
                     time.monotonic() - since)
            handle = self.handles.get(wid)
            if handle is not None:
                self.send(wid, Shutdown())
                self.loop.run_in_executor(None, handle.terminate, 10.0)
        if self._retirees:
            self._retire_timer = self.loop.call_later(RETIRE_CHECK_S, self._stop_idle_retirees)

