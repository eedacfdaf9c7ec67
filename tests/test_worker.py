"""Workers: the step loop in its own process, over the real vLLM engine and the simulator.

Behaviour a worker promises whatever its backend is tested on both (the vLLM
runs are marked `engine`); what only the simulator promises (its cost model,
static batching) is tested on SimBackend directly, in virtual time.
The tiny model's text is gibberish: assertions are on token counts and ids.
"""

from __future__ import annotations

import asyncio
import os
import queue
import signal
import threading
from dataclasses import replace
from pathlib import Path

import pytest

from tokenline.engine.config import WorkerConfig
from tokenline.engine.models import resolve_model
from tokenline.engine.sim_backend import SimBackend
from tokenline.engine.types import (
    Abort,
    Admit,
    FinishReason,
    Sampling,
    SeqOutput,
    StepPlan,
    StepReport,
    WorkerFailed,
    WorkerSpec,
    WorkItem,
)
from tokenline.engine.worker import FAULT_EXIT_CODE, WorkerHandle

WAIT_S = 120.0  # a bound on hangs, not a speed requirement
BACKENDS = ["sim", pytest.param("vllm", marks=pytest.mark.engine)]
GREEDY = Sampling(max_tokens=16, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def tiny_model() -> Path:
    return resolve_model("tiny")  # built once, with its self-check reference, by `make test`


def tiny_config(model: Path, backend: str, **overrides) -> WorkerConfig:
    settings = dict(kv_cache_bytes=64 << 20, max_seqs=16, max_model_len=2048, block_size=128)
    settings.update(overrides)
    return WorkerConfig(model_path=str(model), model_name="tiny", backend=backend, **settings)


class LoopThread:
    """An event loop on a thread of its own, as the frontend's: a WorkerHandle's pipe is served on it."""

    def __init__(self):
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, name="test-loop", daemon=True)
        self.thread.start()

    def call(self, fn, *args):
        """`fn(*args)` run on the loop's thread; its result."""
        async def run():
            return fn(*args)
        return asyncio.run_coroutine_threadsafe(run(), self.loop).result(WAIT_S)


def start_handle(worker_id: int, config: WorkerConfig, on_message, on_exit) -> tuple[WorkerHandle, LoopThread]:
    """A WorkerHandle started on a loop of its own; its callbacks run on that loop's thread."""
    lt = LoopThread()
    return lt.call(lambda: WorkerHandle(worker_id, config, on_message, on_exit, loop=lt.loop).start()), lt


class RunningWorker:
    """A WorkerHandle whose callbacks feed a queue the test reads."""

    def __init__(self, config: WorkerConfig, worker_id: int = 0):
        self.messages: queue.Queue = queue.Queue()
        self.exits: queue.Queue = queue.Queue()
        self.callback_threads: set[str] = set()
        self.handle, self.loop_thread = start_handle(worker_id, config, self._on_message, self._on_exit)
        self.spec = self.next_message()
        if isinstance(self.spec, WorkerFailed):
            raise RuntimeError(f"worker failed to start: {self.spec.message}")
        assert isinstance(self.spec, WorkerSpec)
        self._seq = 0

    def _on_message(self, worker_id: int, msg: object) -> None:
        self.callback_threads.add(threading.current_thread().name)
        self.messages.put(msg)

    def _on_exit(self, worker_id: int, exitcode: int | None) -> None:
        self.callback_threads.add(threading.current_thread().name)
        self.exits.put(exitcode)

    def next_message(self) -> object:
        return self.messages.get(timeout=WAIT_S)

    def admit(self, *items: WorkItem) -> int:
        self._seq += 1
        self.handle.send(Admit(self._seq, items))
        return self._seq

    def reports_until(self, done) -> list[StepReport]:
        """Collect step reports until `done(reports)` holds."""
        reports: list[StepReport] = []
        while not done(reports):
            msg = self.next_message()
            assert isinstance(msg, StepReport)
            reports.append(msg)
        return reports

    def run(self, *items: WorkItem) -> tuple[dict[str, list[SeqOutput]], list[StepReport]]:
        """Admit items and collect until every one has finished or was refused."""
        self.admit(*items)
        keys = {i.key for i in items}
        reports = self.reports_until(lambda rs: keys <= settled(rs))
        return outputs_by_key(reports), reports

    def wait_exit(self) -> int | None:
        return self.exits.get(timeout=WAIT_S)


def settled(reports: list[StepReport]) -> set[str]:
    keys = {o.key for r in reports for o in r.outputs if o.finished}
    return keys | {k for r in reports for k in r.aborted} | {k for r in reports for k in r.rejected}


def outputs_by_key(reports: list[StepReport]) -> dict[str, list[SeqOutput]]:
    by_key: dict[str, list[SeqOutput]] = {}
    for r in reports:
        for o in r.outputs:
            by_key.setdefault(o.key, []).append(o)
    return by_key


def tokens(outputs: list[SeqOutput]) -> list[int]:
    return [t for o in outputs for t in o.new_token_ids]


def item(key: str, prompt: tuple[int, ...] = tuple(range(10, 42)), sampling: Sampling = GREEDY, **kw) -> WorkItem:
    return WorkItem(key=key, prompt_token_ids=prompt, sampling=sampling, **kw)


@pytest.fixture(scope="module", params=BACKENDS)
def worker(request, tiny_model):
    w = RunningWorker(tiny_config(tiny_model, request.param))
    yield w
    w.handle.terminate(timeout=30)


# ------------------------------------------------------------------ any backend


def test_worker_reports_what_it_can_hold_when_ready(worker):
    spec = worker.spec
    assert spec.model == "tiny"
    assert spec.kv_blocks_total > 0 and spec.block_size == 128
    # The engine runs bulk's 16 slots and the ones held for interactive streams.
    assert spec.interactive_slots == WorkerConfig.interactive_slots
    assert spec.engine_seqs == 16 + spec.interactive_slots and spec.max_model_len == 2048
    assert spec.vocab_size > 0 and spec.eos_token_id is not None
    assert spec.pid == worker.handle.pid
    assert len(spec.model_version) == 12


def test_tokens_arrive_incrementally_over_several_steps(worker):
    outputs, _ = worker.run(item("incremental#0"))
    with_tokens = [o for o in outputs["incremental#0"] if o.new_token_ids]
    assert len(with_tokens) > 1
    assert len(tokens(outputs["incremental#0"])) == 16


def test_ignore_eos_gives_exactly_max_tokens(worker):
    sampling = Sampling(max_tokens=37, temperature=0.0, ignore_eos=True)
    outputs, _ = worker.run(item("exact#0", sampling=sampling))
    assert len(tokens(outputs["exact#0"])) == 37
    final = outputs["exact#0"][-1]
    assert final.finished and final.finish_reason == FinishReason.LENGTH
    assert sum(o.finished for o in outputs["exact#0"]) == 1


def test_greedy_decoding_picks_the_models_greedy_tokens_and_their_text(worker, tiny_model):
    # Not "the same tokens every run": vLLM may round differently with another batch shape, and the
    # tiny random model's logits are near ties. Greedy means: each token is the float32 model's
    # best given the tokens before it, up to bf16 noise (tests/greedy.py).
    if worker.handle.config.backend == "sim":
        pytest.skip("the simulated engine's tokens are a function of the prompt, not of a model")
    from tests.greedy import Float32Judge

    outputs, _ = worker.run(item("greedy#0"))
    judge = Float32Judge(tiny_model)
    generated = tokens(outputs["greedy#0"])
    assert judge.violations(list(item("greedy#0").prompt_token_ids), generated) == []
    assert "".join(o.text for o in outputs["greedy#0"]) == judge.streamed_text(generated)


def test_generation_ends_at_a_stop_string_which_is_left_out_of_the_text(worker):
    sampling = Sampling(max_tokens=24, temperature=0.0, ignore_eos=True)
    plain, _ = worker.run(item("unstopped#0", sampling=sampling))
    text = "".join(o.text for o in plain["unstopped#0"])
    middle = len(text) // 2
    stop = next(text[i : i + 3] for i in range(middle, len(text) - 3) if "\ufffd" not in text[i : i + 3])
    stopped, _ = worker.run(item("stopped#0", sampling=replace(sampling, stop=(stop,))))
    assert "".join(o.text for o in stopped["stopped#0"]) == text[: text.find(stop)]
    assert stopped["stopped#0"][-1].finish_reason == FinishReason.STOP_STRING
    assert len(tokens(stopped["stopped#0"])) < 24


def test_each_report_carries_the_latest_admission_it_applied(worker):
    seq = worker.admit(item("stamped#0", sampling=Sampling(max_tokens=3, temperature=0.0, ignore_eos=True)))
    reports = worker.reports_until(lambda rs: "stamped#0" in settled(rs))
    assert all(r.applied_seq == seq for r in reports)


def test_first_scheduling_and_prefill_are_reported_once(worker):
    prompt = tuple(range(5, 105))
    _, reports = worker.run(item("first#0", prompt=prompt, sampling=Sampling(max_tokens=4, temperature=0.0, ignore_eos=True)))
    assert sum(r.first_scheduled.count("first#0") for r in reports) == 1
    assert sum(r.prefill_tokens for r in reports) == len(prompt)
    assert all(r.batch_size >= 1 for r in reports if r.outputs)


def test_room_a_plan_keeps_for_an_interactive_prompt_goes_to_no_bulk_prompt_once_that_prompt_is_done(worker):
    """A plan may allow a long step for an interactive prompt's first token (engine/types.py
    StepPlan.prefill_budget); the scheduler cannot see that the prompt is done by the time the plan is
    carried out. Bulk prompts then get what the step budget allows, not the first token's room; an
    interactive prompt that is owed gets all of it."""
    chat = Sampling(max_tokens=400, temperature=0.0, ignore_eos=True)
    worker.admit(item("chat#0", prompt=tuple(range(10, 42)), sampling=chat))
    worker.reports_until(lambda rs: len(tokens(outputs_by_key(rs).get("chat#0", []))) >= 2)  # decoding
    within, first_token_room, bulk_prompt = 16, 200, tuple(10 + i % 400 for i in range(600))
    worker.handle.send(StepPlan(bulk_decode=4, prefill_tokens=first_token_room, budget_prefill_tokens=within))
    seen: list[StepReport] = []
    try:
        bulk = Sampling(max_tokens=2, temperature=0.0, ignore_eos=True)
        worker.admit(item("bulk#0", prompt=bulk_prompt, sampling=bulk, priority=1),
                     item("bulk#1", prompt=bulk_prompt[1:], sampling=bulk, priority=1))
        during = worker.reports_until(lambda rs: sum(r.prefill_tokens for r in rs) >= 300)
        seen += during
        worker.admit(item("chat#1", prompt=tuple(range(50, 114)), sampling=chat))
        joined = worker.reports_until(lambda rs: "chat#1" in outputs_by_key(rs))
        seen += joined
    finally:
        worker.handle.send(StepPlan())
        keys = {"chat#0", "chat#1", "bulk#0", "bulk#1"}
        worker.handle.send(Abort(tuple(keys)))
        worker.reports_until(lambda rs: keys <= settled(seen + rs))
    # Bulk prompts advance within the step budget (plus the token each running sequence may take), never
    # by the 200 kept for an interactive first token.
    computing = [r.prefill_tokens for r in during if r.prefill_tokens]
    assert computing and max(computing) <= within + 3, computing
    # The interactive prompt that came gets the room: its 64 tokens in the one step that gives its first token.
    assert joined[-1].prefill_tokens >= 64


def test_abort_mid_generation_frees_all_kv_blocks(worker):
    long = Sampling(max_tokens=1500, temperature=0.0, ignore_eos=True)
    worker.admit(item("aborted#0", prompt=tuple(range(10, 300)), sampling=long))
    busy = worker.reports_until(lambda rs: len(tokens(outputs_by_key(rs).get("aborted#0", []))) >= 3)
    assert busy[-1].kv_blocks_free < worker.spec.kv_blocks_total
    worker.handle.send(Abort(("aborted#0",)))
    reports = worker.reports_until(lambda rs: "aborted#0" in settled(rs))
    last = reports[-1]
    assert last.aborted == ["aborted#0"]
    assert last.kv_blocks_free == worker.spec.kv_blocks_total
    assert last.running == 0 and last.waiting == 0
    assert not any(o.finished for r in reports for o in r.outputs if o.key == "aborted#0")


def test_an_item_the_engine_refuses_is_reported_and_the_worker_keeps_serving(worker):
    outputs, reports = worker.run(item("refused#0", prompt=(10, 10**7)), item("fine#0"))
    refused = {k: why for r in reports for k, why in r.rejected.items()}
    assert "refused#0" in refused and refused["refused#0"]
    assert "refused#0" not in outputs
    assert len(tokens(outputs["fine#0"])) == 16


def test_a_vllm_worker_idles_with_one_process_group_not_one_per_kind_of_parallelism(worker):
    """One rank alone: every group vLLM makes is the default one, so one gloo loop thread (it wakes
    every 10 ms) where there were thirteen."""
    if worker.handle.config.backend != "vllm":
        pytest.skip("the simulator makes no process groups")
    names = [Path(f"/proc/{worker.handle.pid}/task/{tid}/comm").read_text().strip()
             for tid in os.listdir(f"/proc/{worker.handle.pid}/task")]
    assert names.count("gloo_tcp_loop") == 1, sorted(names)
    outputs, _ = worker.run(item("after#0"))  # and it still serves
    assert len(tokens(outputs["after#0"])) == 16


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_worker_killed_with_sigkill_is_reported_exited(tiny_model, backend):
    w = RunningWorker(tiny_config(tiny_model, backend))
    w.admit(item("victim#0", sampling=Sampling(max_tokens=1000, temperature=0.0, ignore_eos=True)))
    w.next_message()  # it is mid-generation
    w.handle.kill()
    assert w.wait_exit() == -signal.SIGKILL
    assert not w.handle.is_alive()
    assert w.callback_threads == {"test-loop"}  # its reports and its exit came on the loop, as the frontend's do


@pytest.mark.parametrize("backend", BACKENDS)
def test_the_fault_marker_makes_the_worker_process_exit(tiny_model, backend):
    w = RunningWorker(tiny_config(tiny_model, backend, fault_marker="<<crash>>"))
    w.admit(item("doomed#0", fault_marker=True))
    assert w.wait_exit() == FAULT_EXIT_CODE


def test_the_fault_flag_is_ignored_when_fault_injection_is_off(tiny_model):
    w = RunningWorker(tiny_config(tiny_model, "sim"))
    outputs, _ = w.run(item("harmless#0", fault_marker=True))
    assert len(tokens(outputs["harmless#0"])) == 16
    assert w.handle.terminate(timeout=30) == 0  # from this thread: its Shutdown went through the loop, no SIGTERM
    assert w.wait_exit() == 0


@pytest.mark.engine
def test_a_worker_that_cannot_load_its_model_says_why(tmp_path):
    messages: queue.Queue = queue.Queue()
    exits: queue.Queue = queue.Queue()
    config = WorkerConfig(model_path=str(tmp_path / "missing"), model_name="x", backend="vllm")
    start_handle(0, config, lambda _wid, msg: messages.put(msg), lambda _wid, code: exits.put(code))
    failed = messages.get(timeout=WAIT_S)
    assert isinstance(failed, WorkerFailed) and "config.json" in failed.message
    assert exits.get(timeout=WAIT_S) == 1


# ------------------------------------------------------- the simulator, in-process


class FakeSleep:
    def __init__(self):
        self.total = 0.0

    def __call__(self, seconds: float) -> None:
        self.total += seconds


def sim(model_path, **overrides) -> SimBackend:
    settings = dict(model_path=str(model_path), model_name="sim", backend="sim", max_seqs=8, block_size=32)
    settings.update(overrides)
    return SimBackend(WorkerConfig(**settings), worker_id=3, sleep=FakeSleep())


def drain(backend: SimBackend, limit: int = 10_000) -> list[StepReport]:
    reports = []
    while backend.has_work() and len(reports) < limit:
        reports.append(backend.step())
    return reports


def test_sim_step_time_follows_the_cost_model(tmp_path):
    b = sim(tmp_path, sim_step_base_s=0.01, sim_step_per_seq_s=0.001, sim_prefill_per_token_s=0.0001)
    b.add(item("a", prompt=tuple(range(1, 21))))
    b.add(item("b", prompt=tuple(range(1, 11))))
    first, second = b.step(), b.step()
    assert first.batch_size == 2 and first.prefill_tokens == 30
    assert first.step_s == pytest.approx(0.01 + 0.002 + 0.003)
    assert second.prefill_tokens == 0 and second.step_s == pytest.approx(0.012)
    assert b.sleep.total == pytest.approx(first.step_s + second.step_s)


def test_sim_tokens_depend_only_on_the_prompt(tmp_path):
    one, two = sim(tmp_path), sim(tmp_path, max_seqs=2)
    one.add(item("x"))
    two.add(item("other", prompt=(3, 4, 5)))
    two.add(item("y"))
    a, b = outputs_by_key(drain(one)), outputs_by_key(drain(two))
    assert tokens(a["x"]) == tokens(b["y"])
    assert tokens(b["other"]) != tokens(b["y"])


def test_sim_ends_with_eos_unless_told_to_ignore_it(tmp_path):
    (tmp_path / "config.json").write_text('{"vocab_size": 100, "eos_token_id": 7}')
    b = sim(tmp_path)
    b.add(item("natural", sampling=Sampling(max_tokens=10_000)))
    b.add(item("ignoring", sampling=Sampling(max_tokens=300, ignore_eos=True)))
    out = outputs_by_key(drain(b))
    assert tokens(out["natural"])[-1] == 7 and out["natural"][-1].finish_reason == FinishReason.STOP
    assert 7 not in tokens(out["ignoring"]) and len(tokens(out["ignoring"])) == 300


def test_sim_stops_at_a_stop_string_and_leaves_it_out_of_the_text(tmp_path):
    plain = sim(tmp_path)
    plain.add(item("plain"))
    full = outputs_by_key(drain(plain))["plain"]
    text = "".join(o.text for o in full)
    stop = f" t{tokens(full)[5]}"
    expected = text[: text.find(stop)]
    b = sim(tmp_path)
    b.add(item("stopped", sampling=Sampling(max_tokens=16, temperature=0.0, ignore_eos=True, stop=(stop,))))
    out = outputs_by_key(drain(b))["stopped"]
    assert "".join(o.text for o in out) == expected
    assert out[-1].finish_reason == FinishReason.STOP_STRING and len(tokens(out)) <= 6


def test_sim_text_comes_from_the_model_tokenizer(tiny_model):
    from tokenizers import Tokenizer

    b = sim(tiny_model)
    b.add(item("t", sampling=Sampling(max_tokens=40, ignore_eos=True)))
    out = outputs_by_key(drain(b))["t"]
    decoded = Tokenizer.from_file(str(tiny_model / "tokenizer.json")).decode(tokens(out), skip_special_tokens=True)
    assert "".join(o.text for o in out) == decoded


def test_sim_long_prompts_are_prefilled_in_chunks_of_the_token_budget(tmp_path):
    b = sim(tmp_path, prefill_token_budget=64, max_seqs=8)
    b.add(item("long", prompt=tuple(range(1, 201)), sampling=Sampling(max_tokens=2, ignore_eos=True)))
    reports = drain(b)
    assert [r.prefill_tokens for r in reports[:4]] == [64, 64, 64, 8]
    assert [len(r.outputs) for r in reports[:3]] == [0, 0, 0]


def test_sim_kv_pressure_preempts_but_every_sequence_completes_the_same(tmp_path):
    roomy, tight = sim(tmp_path), sim(tmp_path, kv_cache_bytes=6 * 32 * 16 * 1024)  # 6 blocks of 32 tokens
    assert tight.kv_blocks_total == 6
    items = [item(f"s{i}", prompt=tuple(range(i + 1, i + 40)), sampling=Sampling(max_tokens=50, ignore_eos=True)) for i in range(4)]
    for it in items:
        roomy.add(it)
        tight.add(it)
    tight_reports = drain(tight)
    prompts = sum(len(it.prompt_token_ids) for it in items)
    assert sum(r.prefill_tokens for r in tight_reports) > prompts  # preempted work was computed again
    assert all(r.kv_blocks_free >= 0 for r in tight_reports)
    a, b = outputs_by_key(drain(roomy)), outputs_by_key(tight_reports)
    assert {k: tokens(v) for k, v in a.items()} == {k: tokens(v) for k, v in b.items()}
    assert tight_reports[-1].kv_blocks_free == 6


def test_sim_abort_frees_blocks_and_is_reported(tmp_path):
    b = sim(tmp_path)
    b.add(item("gone", sampling=Sampling(max_tokens=100, ignore_eos=True)))
    b.step()
    b.abort(("gone", "never-heard-of"))
    report = b.step()
    assert report.aborted == ["gone"]
    assert report.kv_blocks_free == b.spec().kv_blocks_total and report.running == 0
    assert not b.has_work()


def test_sim_fixed_batch_runs_a_batch_to_completion_before_the_next(tmp_path):
    b = sim(tmp_path, sim_fixed_batch=True)
    assert b.spec().continuous is False
    b.add(item("short", sampling=Sampling(max_tokens=3, ignore_eos=True)))
    b.add(item("long", sampling=Sampling(max_tokens=6, ignore_eos=True)))
    b.step()
    b.add(item("next", sampling=Sampling(max_tokens=2, ignore_eos=True)))
    reports = [b.step() for _ in range(5)]
    finishing = [r for r in reports if any(o.finished for o in r.outputs)]
    assert len(finishing) == 1  # short and long are reported finished together
    assert {o.key for o in finishing[0].outputs if o.finished} == {"short", "long"}
    assert all(r.batch_size == 2 for r in reports)  # short holds its slot until the batch ends
    assert "next" not in {k for r in reports for k in r.first_scheduled}
    rest = drain(b)
    assert rest[0].first_scheduled == ["next"]


def test_sim_refuses_prompts_it_cannot_run(tmp_path):
    b = sim(tmp_path, max_model_len=64)
    b.add(item("too-long", prompt=tuple(range(1, 100))))
    b.add(item("empty", prompt=()))
    report = b.step()
    assert set(report.rejected) == {"too-long", "empty"}
    assert not b.has_work()


# ------------------------------------------------------------------------ config


@pytest.mark.parametrize(
    "bad, message",
    [
        (dict(backend="tpu"), "vllm, sim"),
        (dict(max_seqs=0), "max_seqs"),
        (dict(block_size=100), "block_size"),
        (dict(prefill_token_budget=8, max_seqs=16), "prefill_token_budget"),
        (dict(kv_cache_bytes=512), "MiB"),
        (dict(fault_marker=""), "None"),
        (dict(sim_step_base_s=-1), "sim_step_base_s"),
    ],
)
def test_worker_config_rejects_bad_settings_with_a_hint(bad, message):
    with pytest.raises(ValueError, match=message):
        WorkerConfig(model_path="/m", model_name="m", **bad)
