"""The chaos soak's callers (bench/chaos.py): a random mix of complete streams, cancelled streams, keyed
streams broken and resumed, durable jobs watched to their end, malformed and oversized requests, each
checked against what a caller is promised, and the tally of what came back.
"""

from __future__ import annotations

import asyncio
import os
import random
import time
from collections import Counter
from dataclasses import dataclass, field

import grpc

from tokenline.v1 import tokenline_pb2 as pb
from tokenline.v1 import tokenline_pb2_grpc as pb_grpc


BAD = {"UNKNOWN", "INTERNAL"}  # answers that mean the server failed, whatever the input


CALL_TIMEOUT_S = 120.0  # a stream that has not ended by then counts as stalled (lost)


@dataclass
class Tally:
    requests: Counter = field(default_factory=Counter)  # by kind
    codes: Counter = field(default_factory=Counter)  # final status name, all kinds
    lost: int = 0  # ended with no finish reason and no error, or stalled past CALL_TIMEOUT_S
    index_errors: int = 0  # a chunk not at the next index: a gap or a repeat
    truncated: int = 0  # finished LENGTH (ignore_eos) with fewer than max_tokens tokens
    stuck_jobs: int = 0  # accepted jobs not ended (or not watchable to their end) within CALL_TIMEOUT_S
    replay_mismatch: int = 0  # a keyed retry's stored result differs from the run it followed
    bad_answers: int = 0  # UNKNOWN or INTERNAL
    faults: Counter = field(default_factory=Counter)
    examples: list[str] = field(default_factory=list)

    def problem(self, what: str) -> None:
        if len(self.examples) < 20:
            self.examples.append(what)


class Traffic:
    """The callers: each `one()` sends one request of a random kind and checks what came back."""

    def __init__(self, channel: grpc.aio.Channel, tally: Tally, rng: random.Random):
        self.stub = pb_grpc.TokenlineStub(channel)
        self.channel = channel
        self.tally, self.rng = tally, rng
        self.n = 0

    async def one(self) -> None:
        self.n += 1
        kinds = ["stream", "cancel", "keyed", "job", "malformed", "oversized"]
        kind = self.rng.choices(kinds, weights=[40, 15, 15, 10, 13, 7])[0]
        self.tally.requests[kind] += 1
        await getattr(self, kind)()

    def _request(self, **extra) -> tuple[pb.GenerateRequest, int]:
        rng = self.rng
        max_tokens = rng.choice([4, 16, 32, 64, 128])
        req = pb.GenerateRequest(text=" ".join(rng.choice(["tell", "a", "story", "about", "chaos", "and", "order"])
                                               for _ in range(rng.randint(1, 60))),
                                 sampling=pb.SamplingParams(max_tokens=max_tokens, temperature=rng.choice([0.0, 0.8]),
                                                            ignore_eos=True),
                                 traffic_class=rng.choice([pb.INTERACTIVE, pb.BULK]),
                                 request_id=f"chaos-{os.getpid()}-{self.n}", **extra)
        return req, max_tokens

    async def _read(self, call, start: int, max_tokens: int, stop_after: int | None = None):
        """(next index, finish reason, status name); checks that indexes run on without gaps or repeats."""
        position, reason, chunks = start, 0, 0
        try:
            async for chunk in call:
                if chunk.index != position and chunk.token_ids:
                    self.tally.index_errors += 1
                    self.tally.problem(f"chunk at index {chunk.index}, expected {position}")
                position = chunk.index + len(chunk.token_ids)
                reason = chunk.finish_reason or reason
                chunks += 1
                if stop_after is not None and chunks >= stop_after:
                    call.cancel()
                    return position, reason, "CANCELLED"
            code = "OK"
        except asyncio.CancelledError:
            raise
        except grpc.aio.AioRpcError as err:
            code = err.code().name
        if code == "OK" and reason == pb.LENGTH and position != max_tokens:
            self.tally.truncated += 1
            self.tally.problem(f"finished LENGTH with {position} of {max_tokens} tokens")
        if code == "OK" and not reason:
            self.tally.lost += 1
            self.tally.problem("a stream ended OK without a finish reason")
        return position, reason, code

    def _count(self, code: str, what: str) -> None:
        self.tally.codes[code] += 1
        if code in BAD:
            self.tally.bad_answers += 1
            self.tally.problem(f"{code} for {what}")
        if code == "DEADLINE_EXCEEDED":
            self.tally.lost += 1  # our calls set no deadline on the server: this one stalled
            self.tally.problem(f"stalled past {CALL_TIMEOUT_S:.0f} s: {what}")

    async def stream(self) -> None:
        req, max_tokens = self._request()
        _, _, code = await self._read(self.stub.Generate(req, timeout=CALL_TIMEOUT_S), 0, max_tokens)
        self._count(code, "a stream")

    async def cancel(self) -> None:
        req, max_tokens = self._request()
        call = self.stub.Generate(req, timeout=CALL_TIMEOUT_S)
        if self.rng.random() < 0.5:  # the caller goes away part-way
            _, _, code = await self._read(call, 0, max_tokens, stop_after=self.rng.randint(1, 4))
        else:  # or cancels by id from another call
            async def cancel_soon():
                await asyncio.sleep(self.rng.uniform(0, 0.2))
                try:
                    await self.stub.Cancel(pb.CancelRequest(request_id=req.request_id), timeout=30)
                except grpc.aio.AioRpcError as err:
                    self._count(err.code().name, "a Cancel call")
            task = asyncio.create_task(cancel_soon())
            _, _, code = await self._read(call, 0, max_tokens)
            await task
        self._count(code, "a cancelled stream")

    async def keyed(self) -> None:
        """A keyed stream broken after a few chunks, resumed where it broke, then asked again from 0."""
        req, max_tokens = self._request(idempotency_key=f"chaos-key-{os.getpid()}-{self.n}")
        first = self.stub.Generate(req, timeout=CALL_TIMEOUT_S)
        position, reason, code = await self._read(first, 0, max_tokens, stop_after=self.rng.randint(1, 3))
        if code == "CANCELLED" and reason:  # it had finished before the caller broke it
            code = "OK"
        elif code == "CANCELLED" and position > 0:
            resumed = pb.GenerateRequest()
            resumed.CopyFrom(req)
            resumed.resume_from_index = position
            position, reason, code = await self._read(self.stub.Generate(resumed, timeout=CALL_TIMEOUT_S), position, max_tokens)
            if code == "OK" and reason == pb.LENGTH:
                await self._replay(req, max_tokens)
        self._count(code, "a keyed stream")

    async def job(self) -> None:
        """A durable job, watched to its end from wherever a broken watch left off: every token once."""
        req, max_tokens = self._request()
        req.ClearField("request_id")
        try:
            job = await self.stub.SubmitJob(pb.SubmitJobRequest(request=req), timeout=30)
        except grpc.aio.AioRpcError as err:  # the store away: UNAVAILABLE, nothing accepted
            self._count(err.code().name, "a job submission")
            return
        position, end = 0, time.monotonic() + CALL_TIMEOUT_S
        while time.monotonic() < end:
            try:
                async for chunk in self.stub.WatchJob(pb.WatchJobRequest(job_id=job.job_id, from_index=position),
                                                      timeout=max(end - time.monotonic(), 1.0)):
                    if chunk.token_ids and chunk.index != position:
                        self.tally.index_errors += 1
                        self.tally.problem(f"job chunk at index {chunk.index}, expected {position}")
                    position = chunk.index + len(chunk.token_ids)
                    if chunk.state:
                        ok = chunk.state == pb.JOB_SUCCEEDED and position == max_tokens
                        if not ok:
                            self.tally.problem(f"job ended {pb.JobState.Name(chunk.state)} with {position} of "
                                               f"{max_tokens} tokens: {chunk.error}")
                            self.tally.truncated += chunk.state == pb.JOB_SUCCEEDED
                        self._count("OK" if ok else pb.JobState.Name(chunk.state), "a job")
                        return
            except grpc.aio.AioRpcError as err:
                if err.code().name in BAD:
                    self._count(err.code().name, "a job watch")
                    return
                await asyncio.sleep(0.5)  # a watch broken by the server: watch again from the next index
        self.tally.stuck_jobs += 1
        self.tally.problem(f"job {job.job_id} not ended {CALL_TIMEOUT_S:.0f} s after it was accepted")

    async def _replay(self, req: pb.GenerateRequest, max_tokens: int) -> None:
        try:
            again = await self.stub.Complete(req, timeout=CALL_TIMEOUT_S)
        except grpc.aio.AioRpcError as err:
            self._count(err.code().name, "a keyed retry")
            return
        if len(again.token_ids) != max_tokens:
            self.tally.replay_mismatch += 1
            self.tally.problem(f"keyed retry returned {len(again.token_ids)} of {max_tokens} tokens")

    async def malformed(self) -> None:
        rng = self.rng
        if rng.random() < 0.5:
            payload = bytes(rng.getrandbits(8) for _ in range(rng.randint(1, 300)))
            call = self.channel.unary_unary("/tokenline.v1.Tokenline/Complete")
            what = "random bytes"
        else:
            req, _ = self._request()
            bad = rng.choice(["nan", "topp", "ids", "resume", "zero", "model", "stop"])
            if bad == "nan":
                req.sampling.temperature = float("nan")
            elif bad == "topp":
                req.sampling.top_p = 7.0
            elif bad == "ids":
                req.token_ids.ids.extend([2**31, 5])
            elif bad == "resume":
                req.resume_from_index = 3
            elif bad == "zero":
                req.sampling.max_tokens = 0
            elif bad == "model":
                req.model = "no-such-model\n"
            else:
                req.sampling.stop.extend(["x" * 300] * 40)
            payload, call, what = req.SerializeToString(), self.channel.unary_unary("/tokenline.v1.Tokenline/Complete"), f"bad {bad}"
        try:
            await call(payload, timeout=CALL_TIMEOUT_S)
            code = "OK"
        except grpc.aio.AioRpcError as err:
            code = err.code().name
        self._count(code, what)

    async def oversized(self) -> None:
        req, _ = self._request()
        size = self.rng.choice([5 << 20, 1 << 20, 200_000])  # past the message limit, past the context, long
        req.text = "z " * (size // 2)
        try:
            await self.stub.Complete(req, timeout=CALL_TIMEOUT_S)
            code = "OK"
        except grpc.aio.AioRpcError as err:
            code = err.code().name
        self._count(code, f"a {size}-character prompt")
