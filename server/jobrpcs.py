"""The job RPCs (SubmitJob, WatchJob, GetJob, CancelJob, ListJobs), mixed into the servicer.

They share the servicer's tenant scoping, request checks and tokenizer pool;
everything durable goes through the job store's thread. A watcher reads only
what the store holds: a token it was sent never changes, whoever finishes the job.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import dataclasses
import json
import math
import re
import time
import uuid
from collections.abc import Callable
from concurrent.futures import Executor

import grpc

from tokenline.server import convert
from tokenline.server.errors import (
    DeadlineUnmeetable,
    IdempotencyMismatch,
    InvalidRequest,
    JobsOff,
    RequestNotFound,
    ServingError,
    Unavailable,
    abort_with,
)
from tokenline.server.jobrunner import JobRunner, job_fingerprint
from tokenline.server.jobstore import MAX_TOKENS_PER_READ, JobRecord, NewJob
from tokenline.v1 import tokenline_pb2 as pb

MAX_PAGE = 1000
DEFAULT_PAGE = 100
WATCH_STORE_RETRY_S = 0.5
JOB_ID = re.compile(r"[0-9a-f]{32}")  # what SubmitJob gives (uuid4 hex); nothing else names a job

_STATE_PB = {"queued": pb.JOB_QUEUED, "running": pb.JOB_RUNNING, "succeeded": pb.JOB_SUCCEEDED,
             "failed": pb.JOB_FAILED, "cancelled": pb.JOB_CANCELLED, "expired": pb.JOB_EXPIRED}
_STATE_NAME = {v: k for k, v in _STATE_PB.items()}
_FINISH_PB = {"stop": pb.STOP, "length": pb.LENGTH, "stop_string": pb.STOP_STRING, "cancelled": pb.CANCELLED,
              "deadline": pb.DEADLINE}


class JobRpcs:
    """The durable-job RPCs (SubmitJob, WatchJob, GetJob, CancelJob, ListJobs), served beside the servicer's
    own (servicer.add_to_server registers them). Their dependencies, given explicitly: the job runner (None:
    the server keeps no job store), what Generate would check a request against (models, default model,
    limits), the thread pool that tokenizes, the caller's tenant, and whether the server is draining."""

    def __init__(self, jobs: JobRunner | None, *, models: dict, default_model: str, limits: convert.Limits,
                 request_work: Executor, tenant: Callable[[grpc.aio.ServicerContext], str],
                 draining: Callable[[], bool]):
        self.jobs = jobs
        self.models = models
        self.default_model = default_model
        self.limits = limits
        self._request_work = request_work
        self._tenant = tenant
        self._draining = draining

    async def SubmitJob(self, request: pb.SubmitJobRequest, context: grpc.aio.ServicerContext) -> pb.Job:  # noqa: N802
        try:
            tenant = self._job_caller(request, context, "SubmitJobRequest")
            if self._draining():
                raise Unavailable("the server is draining for shutdown; submit the job to another instance")
            job = await self._new_job(request, tenant)
            try:
                record, _ = await self.jobs.store.call("submit", job)
            except ValueError as err:
                raise IdempotencyMismatch(str(err)) from None
            self.jobs.wake()
            return job_pb(record)
        except ServingError as err:
            await abort_with(context, err)

    async def WatchJob(self, request: pb.WatchJobRequest, context: grpc.aio.ServicerContext):  # noqa: N802
        try:
            tenant = self._job_caller(request, context, "WatchJobRequest")
            job = await self._get(tenant, request.job_id)
            if job.final and request.from_index > job.tokens:
                raise InvalidRequest(f"from_index {request.from_index} is past the job's end ({job.tokens} tokens)")
        except ServingError as err:
            await abort_with(context, err)
        index = request.from_index
        while True:
            try:
                self._tenant(context)  # a watch ends when its key is revoked (the keys file changed)
            except ServingError as err:
                await abort_with(context, err)
            progress = self.jobs.progress(job.job_id)  # taken before reading: no checkpoint slips between
            try:
                tokens = await self.jobs.reads.call("tokens", job.job_id, index)
                if not tokens:
                    job = await self._get(tenant, job.job_id)
            except Unavailable:  # the store is away: the watcher waits, it is not failed
                await asyncio.sleep(WATCH_STORE_RETRY_S)
                continue
            except ServingError as err:  # purged while watched
                await abort_with(context, err)
            if tokens:
                yield pb.JobChunk(job_id=job.job_id, index=index, token_ids=[t for t, _ in tokens],
                                  text="".join(text for _, text in tokens))
                index += len(tokens)
                continue
            if job.final and index >= job.tokens:
                yield pb.JobChunk(job_id=job.job_id, index=index, state=_STATE_PB[job.state],
                                  finish_reason=_FINISH_PB.get(job.finish_reason or "", 0), error=job.error or "")
                return
            try:
                await asyncio.wait_for(progress.wait(), self.jobs.config.poll_s)
            except asyncio.TimeoutError:
                pass  # another frontend may be running it: look again

    async def GetJob(self, request: pb.GetJobRequest, context: grpc.aio.ServicerContext) -> pb.Job:  # noqa: N802
        try:
            tenant = self._job_caller(request, context, "GetJobRequest")
            job = await self._get(tenant, request.job_id)
            tokens = await self.jobs.reads.call("tokens", job.job_id, 0, MAX_TOKENS_PER_READ)
            out = job_pb(job)
            out.token_ids.extend(t for t, _ in tokens)
            out.text = "".join(text for _, text in tokens)
            return out
        except ServingError as err:
            await abort_with(context, err)

    async def CancelJob(self, request: pb.CancelJobRequest, context: grpc.aio.ServicerContext) -> pb.Job:  # noqa: N802
        try:
            tenant = self._job_caller(request, context, "CancelJobRequest")
            await self._get(tenant, request.job_id)
            job = await self.jobs.store.call("cancel", tenant, request.job_id)
            self.jobs.cancel_local(job.job_id)
            return job_pb(job)
        except ServingError as err:
            await abort_with(context, err)

    async def ListJobs(self, request: pb.ListJobsRequest, context: grpc.aio.ServicerContext) -> pb.ListJobsResponse:  # noqa: N802
        try:
            tenant = self._job_caller(request, context, "ListJobsRequest")
            size = request.page_size or DEFAULT_PAGE
            if size > MAX_PAGE:
                raise InvalidRequest(f"page_size {size} is above the limit of {MAX_PAGE}")
            bad = [s for s in request.states if s not in _STATE_NAME and s != pb.JOB_STATE_UNSPECIFIED]
            if bad:
                raise InvalidRequest(f"states: {bad[0]} is not a JobState (1..6)")
            states = tuple(sorted({_STATE_NAME[s] for s in request.states if s in _STATE_NAME}))
            after = _cursor(request.page_token) if request.page_token else None
            jobs = await self.jobs.reads.call("list", tenant, states, after, size + 1)
            more = len(jobs) > size
            jobs = jobs[:size]
            token = _token(jobs[-1]) if more else ""
            return pb.ListJobsResponse(jobs=[job_pb(j) for j in jobs], next_page_token=token)
        except ServingError as err:
            await abort_with(context, err)

    # ------------------------------------------------------------- helpers

    def _job_caller(self, request, context: grpc.aio.ServicerContext, message: str) -> str:
        if request is convert.MALFORMED:
            raise InvalidRequest(f"the request message could not be parsed as a tokenline.v1.{message}")
        if self.jobs is None:
            raise JobsOff("this server keeps no job store (started with --job-store off); "
                          "use Generate or Complete, or a server with a job store")
        tenant = self._tenant(context)
        job_id = getattr(request, "job_id", None)
        if job_id is not None and not job_id:
            raise InvalidRequest("job_id is required")
        if job_id and not JOB_ID.fullmatch(job_id):  # never sent to the store (a NUL byte is an error there)
            raise RequestNotFound("no such job: job ids are the 32 hexadecimal digits SubmitJob returned")
        return tenant

    async def _get(self, tenant: str, job_id: str) -> JobRecord:
        try:
            return await self.jobs.reads.call("get", tenant, job_id)
        except LookupError:
            # Another tenant's job is indistinguishable from no job at all.
            raise RequestNotFound(f"no job {job_id!r} (unknown, another caller's, or finished and purged)") from None

    async def _new_job(self, request: pb.SubmitJobRequest, tenant: str) -> NewJob:
        if not request.HasField("request"):
            raise InvalidRequest("request is required: the generation to run, as for Generate")
        gen = pb.GenerateRequest()
        gen.CopyFrom(request.request)
        gen.DiscardUnknownFields()  # stored with the job: fields this server does not know are not kept
        if gen.request_id:
            raise InvalidRequest("request.request_id must be empty for a job: the server chooses the job id")
        if gen.resume_from_index:
            raise InvalidRequest("request.resume_from_index must be 0 for a job: use WatchJob's from_index")
        if gen.sampling.n > 1:
            raise InvalidRequest("a job generates one sample (n must be 0 or 1): submit one job per sample")
        if gen.sampling.HasField("logprobs") or gen.sampling.HasField("prompt_logprobs"):
            raise InvalidRequest("a job stores tokens and text, not logprobs: ask for logprobs with Generate or Complete "
                                 "(with an idempotency key to make them safe to retry)")
        if gen.traffic_class == pb.TRAFFIC_CLASS_UNSPECIFIED:
            gen.traffic_class = pb.BULK
        checked = convert.check(gen, self.models, self.default_model, self.limits)
        if checked.tools is not None and checked.tools.parses:
            raise InvalidRequest("a job stores tokens and text, not tool calls: call tools with Generate or Complete "
                                 "(with an idempotency key to make them safe to retry), or send tool_choice NONE")
        key = convert.idempotency_key(gen)
        loop = asyncio.get_running_loop()
        valid = await loop.run_in_executor(self._request_work, convert.tokenize, checked, self.limits)
        deadline = gen.deadline_unix_ms / 1000.0 if gen.deadline_unix_ms else None
        if deadline is not None and deadline <= time.time():
            raise DeadlineUnmeetable("the job's deadline (request.deadline_unix_ms) has already passed")
        # "name": the job takes the version current when it starts; "name@version": that version only.
        asked = valid.model.asked_as(gen.model or self.default_model)
        return NewJob(job_id=uuid.uuid4().hex, tenant=tenant, idempotency_key=key,
                      fingerprint=job_fingerprint(asked, valid.sampling, valid.prompt_ids),
                      model=valid.model.name, request=gen.SerializeToString(), prompt_ids=valid.prompt_ids,
                      sampling=dataclasses.asdict(valid.sampling), cls=int(valid.cls), deadline=deadline,
                      model_version=valid.model.version if asked != valid.model.name else None)


def job_pb(job: JobRecord) -> pb.Job:
    return pb.Job(job_id=job.job_id, state=_STATE_PB[job.state], model=job.model, idempotency_key=job.idempotency_key,
                  attempts=job.attempts, tokens_stored=job.tokens, finish_reason=_FINISH_PB.get(job.finish_reason or "", 0),
                  error=job.error or "", created_unix_ms=int(job.created * 1000),
                  finished_unix_ms=int(job.finished * 1000) if job.finished else 0, model_version=job.model_version or "")


def _token(job: JobRecord) -> str:
    return base64.urlsafe_b64encode(json.dumps([job.created, job.job_id]).encode()).decode()


def _cursor(token: str) -> tuple[float, str]:
    try:
        created, job_id = json.loads(base64.urlsafe_b64decode(token.encode()))
        created = float(created)
        if not math.isfinite(created) or not isinstance(job_id, str) or not JOB_ID.fullmatch(job_id):
            raise ValueError(token)
        return created, job_id
    except (ValueError, TypeError, OverflowError, binascii.Error):
        raise InvalidRequest("page_token is not one this server gave; start again with an empty page_token") from None
