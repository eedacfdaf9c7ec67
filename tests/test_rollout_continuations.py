"""Continuations across model versions (issue 34): a job, an idempotency key and a stream keep to the version
their output came from, or fail saying so; none ever continues on another version.

One server for the module: model "a" serves tiny-trained, "b" serves tiny, with a SQLite job store. Before it
starts, the store holds what a frontend that died mid-job leaves there: jobs whose lease lapsed with their first
tokens stored (greedy for tiny), and a job it never started. The Float32Judges tell the two models' greedy tokens
apart (tiny-trained's margins are real; tiny's logits are near-flat).
"""

from __future__ import annotations

import dataclasses
import uuid

import pytest

from tests.greedy import Float32Judge
from tests.support import ServerProcess, wait_until
from tokenline.client import Client
from tokenline.engine.models import model_version, resolve_model
from tokenline.engine.types import Sampling, TrafficClass
from tokenline.server.auth import DEFAULT_TENANT
from tokenline.server.jobstore import JobStore, NewJob

pytestmark = pytest.mark.engine

TOKENS, STORED = 32, 8  # a job's length, and the tokens the dead frontend stored
STARTED_A, STARTED_B, UNSTARTED = (uuid.uuid4().hex for _ in range(3))
PROMPTS = {STARTED_A: [11, 23, 5, 42], STARTED_B: [12, 23, 6, 42], UNSTARTED: [13, 23, 7, 42]}


@pytest.fixture(scope="module")
def judges():
    return {"tiny": Float32Judge(resolve_model("tiny")), "tiny-trained": Float32Judge(resolve_model("tiny-trained"))}


@pytest.fixture(scope="module")
def versions():
    return {m: model_version(resolve_model(m)) for m in ("tiny", "tiny-trained")}


@pytest.fixture(scope="module")
def stored(tmp_path_factory, judges, versions):
    """The job store a frontend that died mid-job left: job id -> the tokens it stored."""
    path = str(tmp_path_factory.mktemp("jobs") / "jobs.sqlite3")
    store = JobStore(path)
    sampling = dataclasses.asdict(Sampling(max_tokens=TOKENS, temperature=0.0, ignore_eos=True))

    def job(job_id: str, model: str) -> NewJob:
        return NewJob(job_id=job_id, tenant=DEFAULT_TENANT, idempotency_key="", fingerprint=job_id, model=model,
                      request=b"", prompt_ids=PROMPTS[job_id], sampling=sampling, cls=int(TrafficClass.BULK),
                      deadline=None)

    left = {}
    try:
        store.submit(job(STARTED_A, "a"))  # "a" was tiny on the frontend that died
        store.submit(job(STARTED_B, "b"))
        for claimed in store.claim("a-frontend-that-died", 0.001, 10, 5):
            tokens = greedy(judges["tiny"], PROMPTS[claimed.job_id], STORED)
            text = [judges["tiny"].decode([t]) for t in tokens]
            store.append(claimed.job_id, claimed.fence, 0, list(zip(tokens, text)), 0.001, versions["tiny"])
            left[claimed.job_id] = tokens
        store.submit(job(UNSTARTED, "a"))  # never claimed: no token, no version
    finally:
        store.close()
    assert set(left) == {STARTED_A, STARTED_B}
    return path, left


def greedy(judge: Float32Judge, prompt: list[int], n: int) -> list[int]:
    torch, ids = judge.torch, list(prompt)
    with torch.inference_mode():
        for _ in range(n):
            ids.append(int(judge.model(input_ids=torch.tensor([ids])).logits[0, -1].argmax()))
    return ids[len(prompt):]


@pytest.fixture(scope="module")
def server(stored):
    s = ServerProcess("--model", "a=tiny-trained", "--model", "b=tiny", "--kv-cache-mb", "64", "--max-seqs", "8",
                      "--max-model-len", "2048", "--self-check", "off", "--step-watchdog-s", "0",
                      "--job-store", stored[0], "--job-lease-s", "2").start()
    yield s
    s.stop()


def test_a_taken_over_job_continues_on_the_version_of_its_tokens_or_fails_saying_so(server, stored, judges, versions):
    final = ("succeeded", "failed", "cancelled", "expired")
    with Client(server.address) as client:
        assert wait_until(lambda: all(client.get_job(j).state in final for j in PROMPTS), timeout=120)
        started_a, started_b, unstarted = (client.get_job(j) for j in (STARTED_A, STARTED_B, UNSTARTED))
    # Its tokens came from tiny, and "a" is tiny-trained here: it fails, saying so, with what was stored kept.
    assert (started_a.state, started_a.tokens_stored) == ("failed", STORED), started_a
    assert f"a@{versions['tiny']}" in started_a.error and "no longer serves" in started_a.error
    # "b" is still tiny: it continues there, after the stored tokens.
    assert (started_b.state, started_b.tokens_stored, started_b.attempts) == ("succeeded", TOKENS, 2), started_b
    assert started_b.token_ids[:STORED] == stored[1][STARTED_B]
    assert judges["tiny"].violations(PROMPTS[STARTED_B], started_b.token_ids) == []
    # No token yet: it takes the version current when it starts.
    assert unstarted.state == "succeeded", unstarted
    assert judges["tiny-trained"].violations(PROMPTS[UNSTARTED], unstarted.token_ids) == []
    assert len(judges["tiny"].violations(PROMPTS[UNSTARTED], unstarted.token_ids)) >= 8
    store = JobStore(stored[0])
    try:  # what a later takeover would hold each to
        assert [store.get(DEFAULT_TENANT, j).model_version for j in (STARTED_B, UNSTARTED)] == [
            versions["tiny"], versions["tiny-trained"]]
    finally:
        store.close()
