"""Continuations across model versions (issue 34): a job, an idempotency key and a stream keep to the version
their output came from, or fail saying so; none ever continues on another version.

One server for the module: model "a" serves tiny-trained, "b" serves tiny, with a SQLite job store. Before it
starts, the store holds what a frontend that died mid-job leaves there: jobs whose lease lapsed with their first
tokens stored (greedy for tiny), and a job it never started. The server then rolls "a" out to tiny while a stream
runs on tiny-trained, and that stream's worker is killed once its version is draining. The Float32Judges tell
the two models' greedy tokens apart (tiny-trained's margins are real; tiny's logits are near-flat).
"""

from __future__ import annotations

import dataclasses
import os
import re
import signal
import uuid

import grpc
import pytest

from tests.greedy import Float32Judge
from tests.support import ServerProcess, wait_until
from tokenline.client import Client
from tokenline.client.errors import Refused, TokenlineError, Unavailable
from tokenline.engine.models import model_version, resolve_model
from tokenline.engine.types import Sampling, TrafficClass
from tokenline.server.auth import DEFAULT_TENANT
from tokenline.server.jobstore import JobStore, NewJob
from tokenline.v1 import tokenline_pb2 as pb
from tokenline.v1 import tokenline_pb2_grpc as pb_grpc

pytestmark = pytest.mark.engine

TOKENS, STORED = 32, 8  # a job's length, and the tokens the dead frontend stored
STARTED_A, STARTED_B, UNSTARTED, LEGACY = (uuid.uuid4().hex for _ in range(4))
PROMPTS = {STARTED_A: [11, 23, 5, 42], STARTED_B: [12, 23, 6, 42], UNSTARTED: [13, 23, 7, 42], LEGACY: [16, 23, 7, 42]}
WORKER_READY = re.compile(r"worker \d+ ready: model (\S+), pid (\d+)")


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
        store.submit(job(LEGACY, "b"))  # stored by a server from before versions were kept
        for claimed in store.claim("a-frontend-that-died", 0.001, 10, 5):
            tokens = greedy(judges["tiny"], PROMPTS[claimed.job_id], STORED)
            text = [judges["tiny"].decode([t]) for t in tokens]
            version = None if claimed.job_id == LEGACY else versions["tiny"]
            store.append(claimed.job_id, claimed.fence, 0, list(zip(tokens, text)), 0.001, version)
            left[claimed.job_id] = tokens
        store.submit(job(UNSTARTED, "a"))  # never claimed: no token, no version
    finally:
        store.close()
    assert set(left) == {STARTED_A, STARTED_B, LEGACY}
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
        started_a, started_b, unstarted, legacy = (client.get_job(j) for j in (STARTED_A, STARTED_B, UNSTARTED, LEGACY))
    # Its tokens came from tiny, and "a" is tiny-trained here: it fails, saying so, with what was stored kept.
    assert (started_a.state, started_a.tokens_stored) == ("failed", STORED), started_a
    assert f"a@{versions['tiny']}" in started_a.error and "no longer serves" in started_a.error
    # "b" is still tiny: it continues there, after the stored tokens.
    assert (started_b.state, started_b.tokens_stored, started_b.attempts) == ("succeeded", TOKENS, 2), started_b
    assert (started_a.model_version, started_b.model_version) == (versions["tiny"], versions["tiny"])  # GetJob says
    assert started_b.token_ids[:STORED] == stored[1][STARTED_B]
    assert judges["tiny"].violations(PROMPTS[STARTED_B], started_b.token_ids) == []
    # A row from before versions were kept continues on the current version, as the server that wrote it did.
    assert (legacy.state, legacy.tokens_stored) == ("succeeded", TOKENS), legacy
    assert any(f"job {LEGACY}: its stored tokens do not say which version" in line for line in server.lines)
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


@dataclasses.dataclass
class RolledOut:
    """What was seen around the rollout of "a" from tiny-trained to tiny."""

    before: dict[str, list[int]]  # idempotency key -> tokens, answered before the rollout
    stranded: list[int]  # the tokens the stream on the draining version delivered
    stranded_error: TokenlineError | None
    pid_alive_after: bool


KEYED_PROMPT, STREAM_PROMPT = [14, 23, 8, 42], [15, 23, 9, 42]


@pytest.fixture(scope="module")
def rolled_out(server, versions):
    old_pid = next(int(m.group(2)) for m in map(WORKER_READY.search, server.lines) if m and m.group(1) == "a")
    with Client(server.address) as client:
        keyed = dict(token_ids=KEYED_PROMPT, max_tokens=16, temperature=0, ignore_eos=True)
        before = {"unpinned": list(client.complete(model="a", idempotency_key="unpinned", **keyed).token_ids),
                  "pinned": list(client.complete(model=f"a@{versions['tiny-trained']}", idempotency_key="pinned",
                                                 **keyed).token_ids)}
        stream = iter(client.generate(token_ids=STREAM_PROMPT, model="a", max_tokens=1500, temperature=0,
                                      ignore_eos=True, timeout=60))
        delivered = list(next(stream).token_ids)
        os.kill(old_pid, signal.SIGSTOP)  # it holds the stream's run while "a" is rolled out
        try:
            client.roll_out("a", "tiny")
            old_version = f"a@{versions['tiny-trained']}"
            # Retired once its queue is empty: it takes no work and is never restarted.
            assert wait_until(lambda: all(m.workers == 0 for m in client.list_models(timeout=10)
                                          if f"{m.name}@{m.version}" == old_version), timeout=30)
        finally:
            os.kill(old_pid, signal.SIGKILL)
        error = None
        try:
            for delta in stream:
                delivered.extend(delta.token_ids)
        except TokenlineError as err:
            error = err
    return RolledOut(before, delivered, error, _alive(old_pid))


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def test_a_draining_version_that_loses_its_worker_fails_its_streams_and_never_continues_on_the_new_one(
        rolled_out, judges):
    assert not rolled_out.pid_alive_after
    assert isinstance(rolled_out.stranded_error, Unavailable), rolled_out.stranded_error
    assert "replaced by a newer one" in rolled_out.stranded_error.details
    assert 0 < len(rolled_out.stranded) < 1500
    assert judges["tiny-trained"].violations(STREAM_PROMPT, rolled_out.stranded) == []


def test_an_idempotency_key_answers_from_the_version_it_ran_on_across_a_rollout(server, rolled_out, versions, judges):
    keyed = dict(token_ids=KEYED_PROMPT, max_tokens=16, temperature=0, ignore_eos=True)
    with Client(server.address) as client:
        # Naming "a" both times is the same request: its stored result, from tiny-trained, and from an index on.
        again = client.complete(model="a", idempotency_key="unpinned", **keyed)
        assert list(again.token_ids) == rolled_out.before["unpinned"]
        assert resumed(server, "unpinned", "a", 4) == rolled_out.before["unpinned"][4:]
        # A call pinning another version is other work, never answered with tiny-trained's tokens.
        with pytest.raises(Refused, match="different request"):
            client.complete(model=f"a@{versions['tiny']}", idempotency_key="pinned", **keyed)
        # A key first run after the rollout (on the version named "a@<tiny>" inside the server): the same again.
        first = list(client.complete(model="a", idempotency_key="after", **keyed).token_ids)
        assert list(client.complete(model="a", idempotency_key="after", **keyed).token_ids) == first
        assert judges["tiny"].violations(KEYED_PROMPT, first) == []
        # A live keyed run, re-attached from an index: the same run, on its version.
        long = dict(token_ids=STREAM_PROMPT, max_tokens=400, temperature=0, ignore_eos=True)
        stream = iter(client.generate(model="a", idempotency_key="live", **long))
        head = list(next(stream).token_ids)
        tail = resumed(server, "live", "a", len(head), max_tokens=400, prompt=STREAM_PROMPT)
        assert judges["tiny"].violations(STREAM_PROMPT, head + tail) == []
        assert len(head + tail) == 400


def resumed(server, key: str, model: str, index: int, *, max_tokens: int = 16,
            prompt: list[int] = KEYED_PROMPT) -> list[int]:
    """The tokens a stream resumed at `index` with this key gets (Generate with resume_from_index)."""
    request = pb.GenerateRequest(model=model, token_ids=pb.TokenIds(ids=prompt), idempotency_key=key,
                                 resume_from_index=index,
                                 sampling=pb.SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True))
    with grpc.insecure_channel(server.address) as channel:
        chunks = list(pb_grpc.TokenlineStub(channel).Generate(request, timeout=60))
    return [t for c in chunks for t in c.token_ids]
