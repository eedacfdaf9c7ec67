"""Serve while compiling, the supervisor's part (engine/supervisor.py), with stand-in worker handles: eager workers
first, compiled ones built one at a time, each taking over from an eager worker that is stopped only once it runs
nothing; restarts eager before the first compiled worker is active and compiled after; standbys at the end."""

from __future__ import annotations

import asyncio
import dataclasses

from tokenline.engine.config import WorkerConfig
from tokenline.engine.simulation import worker_spec
from tokenline.engine.supervisor import Supervisor
from tokenline.engine.supervisor_swaps import RETIRE_CHECK_S
from tokenline.engine.types import WorkerFailed


class FakeHandle:
    """A worker that is ready, dies or stops when the test says."""

    local = False
    pid = None

    def __init__(self, wid: int, cfg: WorkerConfig, *, on_message, on_exit):
        self.wid, self.cfg, self.on_message, self.on_exit = wid, cfg, on_message, on_exit
        self.stopped = False

    def start(self) -> None:
        pass

    def send(self, msg: object) -> None:
        pass

    def kill(self) -> None:
        self.on_exit(self.wid, -9)

    def terminate(self, timeout: float) -> None:
        self.stopped = True
        self.on_exit(self.wid, 0)

    def ready(self) -> None:
        spec = worker_spec(self.wid, max_seqs=4, continuous=True, model="m")
        self.on_message(self.wid, dataclasses.replace(spec, execution="compiled" if self.cfg.compile else "eager"))


class Harness:
    def __init__(self, workers: int, standby: int = 0):
        self.busy: set[int] = set()
        self.lost: list[int] = []
        self.retired: list[int] = []
        self.handles: dict[int, FakeHandle] = {}

        def factory(wid, cfg, **callbacks):
            self.handles[wid] = FakeHandle(wid, cfg, **callbacks)
            return self.handles[wid]

        cfg = WorkerConfig(model_path="/m", model_name="m", compile=True)
        self.sup = Supervisor({"m": (cfg, workers)}, on_ready=lambda spec: None, on_lost=self.lost.append,
                              on_report=lambda r: None, on_capacity=lambda: None, standby=standby,
                              busy=lambda: set(self.busy), factory=factory, serve_while_compiling=True,
                              on_retire=self.retired.append)

    def compiled(self) -> dict[int, bool]:
        return {wid: h.cfg.compile for wid, h in self.handles.items()}

    def active(self) -> dict[int, str]:
        return {wid: spec.execution for wid, spec in self.sup.specs.items()}


async def settle(seconds: float = 0.05) -> None:
    await asyncio.sleep(seconds)


def test_eager_first_then_one_compiled_worker_at_a_time_each_retiring_an_eager_one_once_it_is_idle():
    async def scenario():
        h = Harness(workers=2, standby=1)
        h.sup.start()
        assert h.compiled() == {0: False, 1: False}  # eager first; the standby waits for the compiled workers
        h.handles[0].ready()
        await settle()
        assert h.compiled() == {0: False, 1: False}  # serving first: worker 1 still loads
        h.handles[1].ready()
        await settle()
        assert h.compiled() == {0: False, 1: False, 2: True}  # one compiled worker is built

        h.busy = {0, 1}
        h.handles[2].ready()
        await settle()
        assert h.active() == {1: "eager", 2: "compiled"} and h.retired == [0]
        await settle(3 * RETIRE_CHECK_S)
        assert h.lost == [] and not h.handles[0].stopped  # it runs something: it finishes first
        assert 3 not in h.handles  # and the next compiled worker waits for its memory

        h.busy = {1}
        await settle(3 * RETIRE_CHECK_S)
        assert h.lost == [0] and h.handles[0].stopped  # idle: reported lost (holding nothing), stopped
        assert h.compiled()[3] is True  # then the next compiled worker is built

        h.busy = set()
        h.handles[3].ready()
        await settle()
        assert h.active() == {2: "compiled", 3: "compiled"} and h.lost == [0, 1]
        assert h.compiled()[4] is True and 4 in h.sup._standby_ids  # the standby, compiled, once all are
        assert h.sup.restarts == 0 and h.sup.swaps["m"] == 2 and not h.sup.swapping
        await h.sup.close()

    asyncio.run(scenario())


def test_a_worker_that_dies_restarts_eager_before_the_first_compiled_worker_is_active_and_compiled_after():
    async def scenario():
        h = Harness(workers=2)
        h.sup.start()
        h.handles[0].ready()
        h.handles[1].ready()
        await settle()
        h.handles[0].kill()  # before any compiled worker is active
        await settle()
        assert h.compiled()[3] is False and h.sup.restarts == 1 and h.lost == [0]
        h.handles[2].ready()  # compiled: takes over from worker 1 (worker 3 still loads)
        await settle()
        assert h.active() == {2: "compiled"} and h.retired == [1]
        h.handles[3].ready()
        await settle()
        h.handles[2].kill()  # after: a compiled restart
        await settle()
        assert h.compiled()[max(h.handles)] is True and h.sup.restarts == 2
        await h.sup.close()

    asyncio.run(scenario())


def test_a_compiled_worker_that_fails_to_start_leaves_the_model_serving_eagerly():
    async def scenario():
        h = Harness(workers=1, standby=1)
        h.sup.start()
        h.handles[0].ready()
        await settle()
        h.handles[1].on_message(1, WorkerFailed(worker_id=1, message="compiling the model failed"))
        h.handles[1].on_exit(1, 1)
        await settle()
        assert h.sup.start_errors == {} and h.active() == {0: "eager"} and h.retired == []
        assert h.compiled()[2] is False and 2 in h.sup._standby_ids  # the standby loads, eager like the rest
        h.handles[0].kill()
        await settle()
        assert h.compiled()[3] is False  # and so does a restart
        await h.sup.close()

    asyncio.run(scenario())
