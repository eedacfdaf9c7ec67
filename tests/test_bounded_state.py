"""Nothing a server keeps grows with the number of requests it has served: every structure is
bounded or expires (the scheduler's drain history, idempotency rows, the quarantine list)."""

import asyncio

from tokenline.engine.scheduler.config import SchedulerConfig
from tokenline.engine.simulation import SimRequest, Simulation, linear_cost, worker_spec
from tokenline.server import idempotency
from tokenline.server.idempotency import IdempotencyStore


def test_the_drain_history_keeps_only_its_window_however_many_requests_finish():
    # 20,000 requests without deadlines, arriving a little faster than one small worker finishes them, so
    # the model is full (the drain history records only then) on and off for ~25 virtual seconds.
    config = SchedulerConfig(drain_window_s=10.0)
    sim = Simulation(config, [(worker_spec(0, max_seqs=4, continuous=True), linear_cost(0.002, 0.0001))])
    out = sim.run([SimRequest(f"r{i}", i * 0.00125, max_tokens=2) for i in range(20_000)])

    assert sum(o.status == "finished" for o in out.values()) == 20_000
    model = sim.scheduler.models["sim"]
    drained, spans = model.drained, model.full_spans
    assert drained and len(drained) <= 10.0 / 0.002 * 4  # one window of finishes at most, not one per request ever
    assert drained[-1][0] - drained[0][0] <= 10.0
    assert len(spans) <= 10.0 / 0.002 and all(end >= drained[-1][0] - 10.0 - 1.0 for _, end in spans)


def test_expired_idempotency_rows_are_purged_while_the_server_runs(tmp_path, monkeypatch):
    monkeypatch.setattr(idempotency, "PURGE_EVERY_S", 0.0)

    async def scenario():
        store = IdempotencyStore(tmp_path / "store.sqlite3", ttl_s=0.2)
        for i in range(50):
            await store.begin("t", f"k{i}", "fp")
            await store.complete("t", f"k{i}", "fp", b"result", ["x"])
        await asyncio.sleep(0.3)
        await store.lookup("t", "another")  # any later call purges what has expired
        rows = store._thread.submit(lambda: store._db.execute("SELECT COUNT(*) FROM idempotency").fetchone()[0]).result()
        store.close()
        return rows

    assert asyncio.run(scenario()) == 0


def test_the_quarantine_list_holds_only_what_is_quarantined_now(monkeypatch):
    from tokenline.server import runtime as runtime_module
    from tokenline.server.runtime import Runtime

    async def scenario():
        rt = Runtime(SchedulerConfig(), {}, quarantine_s=10.0)
        for second in range(1000):  # a new poison request every second, each refused for 10 s
            rt._quarantine(f"fingerprint-{second}", now=float(second))
        expiring = len(rt._quarantined)
        monkeypatch.setattr(runtime_module, "MAX_QUARANTINED", 5)
        for i in range(100):  # many at once: the cap holds, the newest stay
            rt._quarantine(f"burst-{i}", now=1000.0)
        return expiring, sorted(rt._quarantined)

    expiring, left = asyncio.run(scenario())
    assert expiring <= 11
    assert len(left) <= 5 and "burst-99" in left
