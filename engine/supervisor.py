"""Worker supervision: start each model's workers, restart the ones that die, promote standbys,
and kill a worker that falls silent with work in flight.

The supervisor owns the worker handles and what each one is (active or standby, which model,
its spec once it is ready). It decides nothing about requests: it reports back by callbacks,
all called on the event loop it is given:

- `on_ready(spec)`: a worker is ready to take work (a new one, or a standby promoted);
- `on_lost(worker_id)`: an active worker is gone (its runs are the caller's to requeue);
- `on_report(report)`: an active worker finished a step (its StepReport);
- `on_capacity()`: the set of ready workers changed (after `on_ready`/`on_lost`).

With an `autoscale` config, it also adds and removes workers on the autoscaler's decisions
(engine/autoscale.py), checked every AUTOSCALE_CHECK_S from `pressure(model, now, starting,
idle_since)`: a worker added is one more active worker; a worker removed is an idle one, told
to the caller as lost first (it holds no runs) so nothing is sent to it, then stopped and not
restarted.

A handle is anything with the `WorkerHandle` contract (engine/worker.py): built as
`factory(worker_id, config, on_message=..., on_exit=...)`, with `start()`, `send(msg)`,
`kill()` and `terminate(timeout)`; its callbacks may come from any thread. A local process
and a Ray actor (engine/ray_workers.py) both fit.

With `serve_while_compiling`, a model whose workers are to be compiled starts them eager and swaps compiled
workers in one at a time (engine/supervisor_swaps.py). A worker that dies restarts compiled once the model's first
compiled worker is active, eager before; standby workers are started (compiled) once every active worker is. A
compiled worker that fails to start (compiling failed) leaves the model serving eagerly.

With `cpu_sets` (engine/machine.py pin_sets), each active worker that is a local process is bound to
the set fewest active workers hold, once it is ready (a new worker, a restart, a standby promoted):
the set of a worker that died is free again for the one that takes its place.
"""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import logging
import time
from collections.abc import Callable
from typing import Any

from tokenline.engine.autoscale import AddWorker, AutoscaleConfig, Autoscaler, GiveBack, Pressure, Share, share_workers
from tokenline.engine.config import WorkerConfig
from tokenline.engine.machine import cpu_list_text, pin_process
from tokenline.engine.supervisor_swaps import SwapIns
from tokenline.engine.types import Shutdown, StepReport, WorkerFailed, WorkerSpec
from tokenline.engine.watchdog import StepWatchdog
from tokenline.engine.worker import WorkerHandle

log = logging.getLogger("tokenline.runtime")

WATCHDOG_CHECK_S = 0.5  # how often silent workers are looked for
AUTOSCALE_CHECK_S = 0.5  # how often the autoscaler reads the queues


class Supervisor(SwapIns):
    def __init__(self, workers: dict[str, tuple[WorkerConfig, int]], *,
                 on_ready: Callable[[WorkerSpec], None], on_lost: Callable[[int], None],
                 on_report: Callable[[StepReport], None], on_capacity: Callable[[], None],
                 restart: bool = True, standby: int = 0, watchdog: StepWatchdog | None = None,
                 busy: Callable[[], set[int]] = set, heaviest_step_s: Callable[[int], float] = lambda wid: 0.0,
                 factory: Callable[..., Any] = WorkerHandle, autoscale: AutoscaleConfig | None = None,
                 pressure: Callable[[str, float, int, dict[int, float]], Pressure] | None = None,
                 cpu_sets: tuple[tuple[int, ...], ...] = (), serve_while_compiling: bool = False,
                 on_retire: Callable[[int], None] = lambda wid: None, share: Share | None = None):
        self.loop = asyncio.get_running_loop()
        self.worker_configs = workers
        self.on_ready, self.on_lost, self.on_report, self.on_capacity = on_ready, on_lost, on_report, on_capacity
        self.restart = restart
        self.standby = standby  # per model: loaded, idle, promoted the moment an active worker dies
        self.watchdog = watchdog  # None: a hung worker is never declared lost
        self.busy = busy  # workers with work in flight (the scheduler knows)
        self.heaviest_step_s = heaviest_step_s  # the step-time model's estimate of a worker's heaviest step
        self.factory = factory  # how a worker is started: a local process, or a Ray actor
        self.handles: dict[int, Any] = {}
        self.specs: dict[int, WorkerSpec] = {}  # ready, active workers
        self.restarts = 0
        self.start_errors: dict[str, str] = {}  # model -> why its worker could not start (never restarted)
        self._next_id = 0
        self._model_of: dict[int, str] = {}
        self._standby_ids: set[int] = set()  # spawned as standby, not yet promoted
        self._standby_ready: dict[str, dict[int, WorkerSpec]] = {name: {} for name in workers}
        self._closing = False
        self._watch_timer: asyncio.TimerHandle | None = None
        self.target = {name: count for name, (_, count) in workers.items()}  # active workers wanted per model
        self.autoscalers = {name: Autoscaler(autoscale) for name in workers} if autoscale and pressure else {}
        self.pressure = pressure
        self.share = share  # several models under one worker budget (autoscale.py share_workers); None: each alone
        self.given_back: set[int] = set()  # borrowed workers retiring for the model that lent them
        self._retiring: set[int] = set()  # removed by the autoscaler: their exit is no crash
        self._idle_since: dict[int, float] = {}
        self._scale_timer: asyncio.TimerHandle | None = None
        self.scale_decisions: collections.Counter[tuple[str, str]] = collections.Counter()  # (model, "add"|"remove")
        self.cpu_sets = cpu_sets  # CPUs to bind active local workers to, one set each (empty: the OS places them)
        self.cpu_set_of: dict[int, int] = {}  # worker -> index into cpu_sets, while it is active
        self._spawned_at: dict[int, float] = {}
        self.startup_s: dict[str, float] = {}  # model -> how long its last worker took from spawn to ready
        # Serve while compiling: models started eager whose compiled workers are still to swap in.
        self.on_retire = on_retire
        self.retired_models: set[str] = set()  # versions rolled out of service: their workers are never restarted
        self.swapping: set[str] = {name for name, (cfg, _) in workers.items() if serve_while_compiling and cfg.compile}
        self.compiled_active: set[str] = set()  # models whose first compiled worker is active: restarts compile
        self.compile_failed: dict[str, str] = {}  # model -> why its compiled worker could not start (serves eager)
        self.swaps: collections.Counter[str] = collections.Counter()  # model -> eager workers a compiled one replaced
        self._eager: set[int] = set()  # workers started eager in a model still swapping (active or loading)
        self._loading_behind: dict[int, int] = {}  # eager workers loading at low CPU priority -> niceness to restore
        self._swap_in: dict[str, int] = {}  # model -> the compiled worker being built
        self._retirees: dict[int, float] = {}  # handed over, finishing their runs -> since when
        self._retired: set[int] = set()  # retirees stopped once idle, until they exit
        self._retire_timer: asyncio.TimerHandle | None = None
        self._started_at = 0.0

    def start(self) -> None:
        self._started_at = time.monotonic()
        if self.watchdog is not None:
            self._watch_timer = self.loop.call_later(WATCHDOG_CHECK_S, self._check_silence)
        if self.autoscalers:
            self._scale_timer = self.loop.call_later(AUTOSCALE_CHECK_S, self._autoscale)
        for model, (_, count) in self.worker_configs.items():
            for i in range(count):
                wid = self._spawn(model, self._config(model))
                if i and model in self.swapping:  # the first eager worker serves sooner without the others beside it
                    self._load_behind(wid)
            if model not in self.swapping:  # else once every active worker is compiled
                for _ in range(self.standby):
                    self._spawn(model, self._config(model), standby=True)

    def _config(self, model: str) -> WorkerConfig:
        """What a new worker of `model` runs: eager while the model serves eagerly, waiting for its compiled workers."""
        cfg = self.worker_configs[model][0]
        eager = model not in self.compiled_active and (model in self.swapping or model in self.compile_failed)
        return dataclasses.replace(cfg, compile=False) if eager and cfg.compile else cfg

    def send(self, worker_id: int | None, msg: object) -> None:
        """To a live worker; a message to one that is gone (or going) is dropped: its exit reports it."""
        handle = self.handles.get(worker_id) if worker_id is not None else None
        if handle is None:
            return
        try:
            handle.send(msg)
        except (BrokenPipeError, OSError, EOFError):
            pass  # its exit is being reported; its runs will be requeued then

    def send_to_model(self, model: str, msg: object) -> None:
        """To every live worker of `model`: active, standby, loading or finishing its runs."""
        for wid, handle in list(self.handles.items()):
            if self._model_of.get(wid) == model:
                self.send(wid, msg)

    def expect(self, worker_id: int) -> None:
        """Work went to a worker that had none: its silence so far was no hang."""
        if self.watchdog is not None:
            self.watchdog.expect(worker_id, time.monotonic(), self.heaviest_step_s(worker_id))

    async def close(self, timeout: float = 5.0) -> None:
        self._closing = True
        for timer in (self._watch_timer, self._scale_timer, self._retire_timer):
            if timer is not None:
                timer.cancel()
        for h in list(self.handles.values()):
            try:
                h.send(Shutdown())
            except (BrokenPipeError, OSError, EOFError):
                pass
        await asyncio.gather(*(asyncio.to_thread(h.terminate, timeout) for h in list(self.handles.values())))
        self.handles.clear()

    # ------------------------------------------------------------ internals

    # ------------------------------------------------------------ scaling

    def add_worker(self, model: str) -> int:
        """One more active worker for `model`; returns its id (it is ready when `on_ready` says so)."""
        self.target[model] += 1
        return self._spawn(model, self._config(model))

    def remove_worker(self, worker_id: int) -> bool:
        """Stop an active worker for good: reported lost now (so nothing more is sent to it), then
        stopped, and not restarted. Meant for an idle worker: runs it holds would start over elsewhere."""
        model = self._model_of.get(worker_id)
        handle = self.handles.get(worker_id)
        if model is None or handle is None or worker_id not in self.specs:
            return False
        self.target[model] -= 1
        self._retiring.add(worker_id)
        self.specs.pop(worker_id)
        self.cpu_set_of.pop(worker_id, None)
        self.on_lost(worker_id)
        self.on_capacity()
        self.loop.run_in_executor(None, handle.terminate, 10.0)
        return True

    def retire_worker(self, worker_id: int) -> bool:
        """Stop an active worker without dropping a stream: no new work for it (`on_retire`), stopped once it runs
        nothing, not restarted (a worker given back to the model that lent it: autoscale.py share_workers)."""
        model = self._model_of.get(worker_id)
        if model is None or worker_id not in self.specs:
            return False
        self.target[model] -= 1
        self.given_back.add(worker_id)
        self._retirees[worker_id] = time.monotonic()
        self.specs.pop(worker_id)
        self.cpu_set_of.pop(worker_id, None)
        self.on_retire(worker_id)
        self.on_capacity()
        self._stop_idle_retirees()
        return True

    def _workers_in_use(self) -> int:
        """Worker processes counted against a shared budget: every one but standbys and a compiled one being built
        (active, starting, and those finishing their streams or stopping all hold memory)."""
        building = set(self._swap_in.values())
        return sum(1 for w in self._model_of if w not in self._standby_ids and w not in building)

    # ------------------------------------------------------------ versions (server/admin.py)

    def add_model(self, model: str, cfg: WorkerConfig, count: int) -> None:
        """A model (a version rolled out) added while serving: its workers start now, built as configured."""
        self.worker_configs[model] = (cfg, count)
        self.target[model] = count
        self._standby_ready[model] = {}
        for _ in range(count):
            self._spawn(model, cfg)

    def retire_model(self, model: str) -> None:
        """Stop serving `model` without dropping a stream: each active worker retires (`on_retire`: no new work;
        stopped once it runs nothing), its standby and loading workers stop, and none of them is restarted."""
        self.retired_models.add(model)
        self.target[model] = 0
        self.swapping.discard(model)
        for wid, m in list(self._model_of.items()):
            if m != model or wid in self._retirees or wid in self._retiring:
                continue
            if wid in self.specs:
                self._retirees[wid] = time.monotonic()
                self.specs.pop(wid)
                self.cpu_set_of.pop(wid, None)
                self.on_retire(wid)
            else:
                self._retiring.add(wid)
                self.loop.run_in_executor(None, self.handles[wid].terminate, 10.0)
        self.on_capacity()
        self._stop_idle_retirees()

    def workers_of(self, model: str) -> int:
        """Worker processes of `model` still running (active, loading, standby or finishing their runs)."""
        return sum(1 for m in self._model_of.values() if m == model)

    def starting(self, model: str) -> int:
        """Active workers of `model` asked for and not ready yet."""
        return sum(1 for w, m in self._model_of.items() if m == model and w not in self.specs and w not in self._standby_ids
                   and w not in self._retiring and w not in self._retirees and w != self._swap_in.get(model))

    def _autoscale(self) -> None:
        if self._closing:
            return
        now = time.monotonic()
        busy = self.busy()
        for wid in self.specs:
            if wid in busy:
                self._idle_since.pop(wid, None)
            else:
                self._idle_since.setdefault(wid, now)
        decisions, pressures = {}, {}
        for model, scaler in self.autoscalers.items():
            if model in self.start_errors or model in self.retired_models:
                continue
            pressures[model] = self.pressure(model, now, self.starting(model), self._idle_since)
            decisions[model] = scaler.decide(now, pressures[model])
        if self.share is not None:  # several models under one budget: lend idle workers, take borrowed ones back
            minimum = {m: s.config.min_workers for m, s in self.autoscalers.items()}
            actions = share_workers(decisions, pressures, minimum, self.share, now, in_use=self._workers_in_use())
        else:
            actions = [(m, d) for m, ds in decisions.items() for d in ds]
        for model, decision in actions:
            if isinstance(decision, AddWorker):
                wid = self.add_worker(model)
                self.scale_decisions[model, "add"] += 1
                log.warning("autoscale: adding worker %d for model %s (%d → %d workers): %s", wid, model,
                            self.target[model] - 1, self.target[model], decision.reason)
            elif isinstance(decision, GiveBack):
                if self.retire_worker(decision.worker_id):
                    self.scale_decisions[model, "give back"] += 1
                    log.warning("autoscale: retiring worker %d of model %s (%d → %d workers; it finishes its streams): "
                                "%s", decision.worker_id, model, self.target[model] + 1, self.target[model],
                                decision.reason)
            elif decision.worker_id not in busy and self.remove_worker(decision.worker_id):
                self.scale_decisions[model, "remove"] += 1
                log.warning("autoscale: removing worker %d of model %s (%d → %d workers): %s", decision.worker_id,
                            model, self.target[model] + 1, self.target[model], decision.reason)
        self._scale_timer = self.loop.call_later(AUTOSCALE_CHECK_S, self._autoscale)

    def _spawn(self, model: str, cfg: WorkerConfig, *, standby: bool = False) -> int:
        wid = self._next_id
        self._next_id += 1
        self._model_of[wid] = model
        self._spawned_at[wid] = time.monotonic()
        if standby:
            self._standby_ids.add(wid)
        if model in self.swapping and not cfg.compile:
            self._eager.add(wid)
        if getattr(self.factory, "reads_on_loop", False):  # a local process: its pipe is served on this loop
            handle = self.factory(wid, cfg, on_message=self._on_message, on_exit=self._on_exit, loop=self.loop)
        else:  # its callbacks come on its own threads
            handle = self.factory(
                wid, cfg,
                on_message=lambda w, m: self.loop.call_soon_threadsafe(self._on_message, w, m),
                on_exit=lambda w, code: self.loop.call_soon_threadsafe(self._on_exit, w, code),
            )
        self.handles[wid] = handle
        handle.start()
        return wid

    def _on_message(self, wid: int, msg: object) -> None:
        if isinstance(msg, StepReport):
            if self.watchdog is not None:
                self.watchdog.saw_step(wid, msg.step_s, time.monotonic(), self.heaviest_step_s(wid))
            self.on_report(msg)
            if wid in self._retirees:
                self._stop_idle_retirees()
        elif isinstance(msg, WorkerSpec) and wid in self._standby_ids:
            self._standby_ready[msg.model][wid] = msg
            log.info("standby worker %d ready: model %s, pid %d", wid, msg.model, msg.pid)
        elif isinstance(msg, WorkerSpec) and wid == self._swap_in.get(msg.model):
            self._take_over(wid, msg)
        elif isinstance(msg, WorkerSpec):
            self._activate(wid, msg)
        elif isinstance(msg, WorkerFailed) and wid in self._swap_in.values():
            model = self._model_of.get(wid, "?")
            self.compile_failed[model] = msg.message
            log.error("compiled worker %d failed to start: %s; model %s keeps serving eagerly", wid, msg.message, model)
        elif isinstance(msg, WorkerFailed):
            self.start_errors[self._model_of.get(wid, "?")] = msg.message
            log.error("worker %d failed to start: %s", wid, msg.message)

    def scales_from_zero(self, model: str) -> bool:
        """The autoscaler may leave `model` without workers and start one when work comes."""
        scaler = self.autoscalers.get(model)
        return scaler is not None and scaler.config.min_workers == 0 and model not in self.start_errors

    def _activate(self, wid: int, spec: WorkerSpec) -> None:
        self.specs[wid] = spec
        self._full_priority(wid)
        spawned = self._spawned_at.pop(wid, None)
        if spawned is not None:
            self.startup_s[spec.model] = time.monotonic() - spawned
        self._pin(wid)
        log.info("worker %d ready: model %s, pid %d, %d KV blocks of %d, %d seqs, %s, %s, attention kernel %s, "
                 "single-sequence step %.2f ms, self-check %s",
                 wid, spec.model, spec.pid, spec.kv_blocks_total, spec.block_size, spec.engine_seqs, spec.dtype or "-",
                 spec.execution or "-", spec.attention_kernel or "-", spec.single_step_s * 1000, spec.self_check or "-")
        placement = getattr(self.handles.get(wid), "placement", None)
        if placement is not None:  # a Ray actor: where Ray put it
            log.info("worker %d ready: model %s on Ray node %s (host %s, pid %d)", wid, spec.model, placement.node_id,
                     placement.host, placement.pid)
        self.on_ready(spec)
        self.on_capacity()
        self._next_swap(spec.model)

    def _on_exit(self, wid: int, exitcode: int | None) -> None:
        if self.watchdog is not None:
            self.watchdog.forget(wid)
        handle = self.handles.pop(wid, None)
        self.specs.pop(wid, None)
        self.cpu_set_of.pop(wid, None)
        model = self._model_of.pop(wid, None)
        was_standby = wid in self._standby_ids
        self._standby_ids.discard(wid)
        if model is not None:
            self._standby_ready[model].pop(wid, None)
        self._idle_since.pop(wid, None)
        self._eager.discard(wid)
        if wid in self._retiring:  # removed, or retired once idle: already reported lost, not restarted
            self._retiring.discard(wid)
            why = "retirement" if wid in self._retired else "removal"
            self._retired.discard(wid)
            log.info("worker %d (model %s) stopped after %s, exit code %s", wid, model, why, exitcode)
            if model is not None:
                self._next_swap(model)
            return
        if handle is None or self._closing:
            return
        if self._retirees.pop(wid, None) is not None:  # died while finishing its runs: they go on elsewhere
            log.warning("retiring worker %d (model %s) exited with code %s before its runs finished", wid, model, exitcode)
            self.on_lost(wid)
            if model is not None:
                self._next_swap(model)
            return
        if model is not None and self._swap_in.get(model) == wid:  # the compiled worker being built
            del self._swap_in[model]
            if model in self.compile_failed:
                self._next_swap(model)  # no more: the model serves eagerly (and its standbys load)
                return
            log.warning("compiled worker %d (model %s) exited with code %s while loading; building another", wid,
                        model, exitcode)
            self.restarts += 1
            self._next_swap(model)
            return
        log.warning("%sworker %d (model %s) exited with code %s", "standby " if was_standby else "", wid, model, exitcode)
        if not was_standby:
            self.on_lost(wid)
            if model is None or not self._promote_standby(model):
                self.on_capacity()
        if self.restart and model is not None and model not in self.start_errors and model not in self.retired_models:
            self.restarts += 1
            # A promoted standby is replaced by a new standby; otherwise the worker itself restarts.
            standby = was_standby or (self.standby > 0 and len(self._standby_ids) < self.standby)
            self._spawn(model, self._config(model), standby=standby and not self._needs_active(model))

    def _pin(self, wid: int) -> None:
        """Bind an active local worker to the CPU set fewest active workers hold (the lowest on a tie)."""
        handle = self.handles.get(wid)
        if not self.cpu_sets or not getattr(handle, "local", False) or handle.pid is None:
            return
        held = collections.Counter(self.cpu_set_of.values())
        index = min(range(len(self.cpu_sets)), key=lambda i: (held[i], i))
        if pin_process(handle.pid, self.cpu_sets[index]):
            self.cpu_set_of[wid] = index
            log.info("worker %d pinned to CPUs %s", wid, cpu_list_text(self.cpu_sets[index]))

    def _promote_standby(self, model: str) -> bool:
        """Put a loaded standby worker to work at once, in place of one that died."""
        ready = self._standby_ready[model]
        if not ready:
            return False
        wid, spec = ready.popitem()
        self._standby_ids.discard(wid)
        log.warning("standby worker %d takes over for model %s", wid, model)
        self._activate(wid, spec)
        return True

    def _needs_active(self, model: str) -> bool:
        """Fewer active (or loading, non-standby) workers than configured."""
        active = sum(1 for w, m in self._model_of.items() if m == model and w not in self._standby_ids
                     and w not in self._retiring and w not in self._retirees and w != self._swap_in.get(model))
        return active < self.target[model]

    def _check_silence(self) -> None:
        """Kill a worker that has work in flight but has stopped reporting steps (hung, stopped):
        its exit then takes the path of any crash, and its runs continue as new attempts."""
        if self._closing or self.watchdog is None:
            return
        for silence in self.watchdog.silent(self.busy(), time.monotonic()):
            handle = self.handles.get(silence.worker_id)
            if handle is None:
                continue
            log.error("worker %d sent no step report for %.1f s with work in flight (limit %.1f s): declared lost, killing it",
                      silence.worker_id, silence.silent_s, silence.limit_s)
            self.watchdog.forget(silence.worker_id)
            handle.kill()
        self._watch_timer = self.loop.call_later(WATCHDOG_CHECK_S, self._check_silence)
