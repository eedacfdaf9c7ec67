"""What the scheduler keeps per request, and the actions it emits."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

from tokenline.engine.scheduler.status import FINAL, Status
from tokenline.engine.types import FinishReason, PositionLogprobs, StepPlan, StepReport, TrafficClass

RUN_SEPARATOR = "@"  # run key = f"{request key}@{run}": the one place the format is written and read


@dataclass
class Entry:
    """One request's lifecycle, owned by the scheduler (all of its attempts).

    The one place for its attempt, current run (key and worker), tokens generated, status and
    waits; the server's RequestState holds the same object and reads these from it.
    """

    key: str  # unique among requests in flight (the frontend scopes it by tenant)
    model: str
    tenant: str
    cls: TrafficClass
    prompt_tokens: int
    max_tokens: int
    arrival: float  # when it was enqueued; kept while it waits, whatever happens to workers
    deadline: float | None = None
    must_complete_by_deadline: bool = False  # refuse unless the whole completion fits, not just its first token
    itl_target_s: float | None = None  # interactive: its own inter-token latency target (None: its class's)
    group: str | None = None  # n > 1: the call's request key, shared by its samples (placement.py)
    cached_prompt: int = 0  # this run: prompt tokens a sibling on its worker holds in the prefix cache (placement.py)
    status: Status = Status.QUEUED
    attempt: int = 1
    run: int = 0  # admissions so far (a preemption re-admits without a new attempt)
    generated: int = 0  # tokens produced by earlier runs and this one
    crashes: int = 0  # workers that died while it was running
    suspect_group: int = 0  # isolated: the group it reruns with, apart from all other work (0: none)
    prefilled: bool = False  # this run has produced a token, so its prompt is computed
    preemptions: int = 0
    worker_id: int | None = None
    blocks: int = 0  # KV blocks reserved on its worker
    est_finish: float = 0.0
    first_token_at: float | None = None  # when this run's first token came (its worker's report)
    tokens_this_run: int = 0  # tokens this run made
    # accounting
    no_capacity_at_enqueue: float = 0.0
    queueing_s: float = 0.0
    admission_wait_s: float = 0.0
    queued_since: float = 0.0

    @property
    def cost(self) -> int:
        """Tokens it may occupy: prompt plus new tokens still owed."""
        return self.prompt_tokens + self.max_tokens

    @property
    def prefill_tokens(self) -> int:
        """What this run's worker computes before its first token: prompt and tokens delivered before, less the
        prefix cache's share (set when it is admitted)."""
        return self.prompt_tokens + self.generated - self.cached_prompt

    @property
    def remaining(self) -> int:
        return max(self.max_tokens - self.generated, 0)

    @property
    def run_key(self) -> str:
        """The worker-side id of the current run; output of older runs is stale."""
        return f"{self.key}{RUN_SEPARATOR}{self.run}"

    @property
    def done(self) -> bool:
        return self.status in FINAL


def request_of(run_key: str) -> str:
    """The request key a run key was built from (see Entry.run_key)."""
    return run_key.rsplit(RUN_SEPARATOR, 1)[0]


class Refusal(enum.Enum):
    QUEUE_FULL = "queue_full"
    TENANT_LIMIT = "tenant_limit"
    DEADLINE = "deadline_unmeetable"
    NO_WORKER = "no_worker"
    TOO_LARGE = "too_large"
    DUPLICATE = "duplicate_request"
    NO_ROOM_IN_TIME = "no_room_in_time"  # interactive: no worker can give its first token within the TTFT target (opt-in)


@dataclass(frozen=True)
class Admission:
    key: str
    run_key: str
    attempt: int
    generated: int  # tokens already delivered: the run continues after them
    queueing_s: float  # this wait: time queued while no worker had room
    admission_wait_s: float  # this wait: time queued while some worker had room


@dataclass(frozen=True)
class Admit:
    """Admit these runs into a worker at its next step boundary: the worker receives them as one Admit message
    (engine/types.py), their WorkItems."""

    worker_id: int
    seq: int
    admissions: tuple[Admission, ...]
    idle_before: bool = False  # the worker ran nothing until these (its silence so far was no hang)


@dataclass(frozen=True)
class Refuse:
    key: str
    reason: Refusal
    message: str
    retry_after_s: float | None = None


@dataclass(frozen=True)
class Expire:
    """Deadline passed: answer DEADLINE_EXCEEDED; abort the run if there is one."""

    key: str
    worker_id: int | None = None
    run_key: str | None = None


@dataclass(frozen=True)
class Abort:
    """Abort a run in its worker (cancel, preemption); frees its KV at once. The worker receives an Abort message
    (engine/types.py) with its run key."""

    key: str
    worker_id: int
    run_key: str
    preempted: bool = False


@dataclass(frozen=True)
class Fail:
    key: str
    message: str
    quarantined: bool = False


@dataclass(frozen=True)
class Retry:
    """Its worker died; it goes again as `attempt`, continuing after `generated`."""

    key: str
    attempt: int


@dataclass(frozen=True)
class SetPlan:
    """Compose this worker's coming steps by `plan` (composition.py) until told otherwise: the worker receives
    the StepPlan itself and its backend applies it (engine/backend.py set_plan)."""

    worker_id: int
    plan: StepPlan


Action = Admit | Refuse | Expire | Abort | Fail | Retry | SetPlan  # what the scheduler decides; the runtime carries out


@dataclass(slots=True)
class Delivery:
    """New tokens of a request's current run, for its caller; `finish_reason` set: the run ended.
    One per sequence per step: slotted, not frozen (a frozen dataclass costs ~4× as much to make)."""

    key: str
    token_ids: list[int]
    text: str
    finish_reason: FinishReason | None = None
    logprobs: list[PositionLogprobs] | None = None  # one per token, when the request asked for them
    prompt_logprobs: list[PositionLogprobs] | None = None  # with a run's first output, when asked
    cached_tokens: int | None = None  # with a run's first output: prompt tokens the prefix cache held


@dataclass
class StepResult:
    """What one step report means, from the scheduler's one loop over it (Scheduler.on_step).

    The runtime delivers `deliveries` and `rejected` to callers, stamps `started`, then carries
    out `actions`; observers (telemetry, the step log) read this rather than the raw report.
    """

    report: StepReport
    started: list[str] = field(default_factory=list)  # requests whose current run entered the engine
    deliveries: list[Delivery] = field(default_factory=list)
    rejected: list[tuple[str, str]] = field(default_factory=list)  # (request key, the engine's reason)
    actions: list[Action] = field(default_factory=list)
    interactive: int = 0  # interactive runs on the worker during the step
    plan: StepPlan | None = None  # the step plan the step ran under
    # The worker's interactive ITL target in seconds where this report moved it: a target in single steps follows
    # the worker's measured single step once that leaves the band around the one it was named from (pace.py).
    itl_target_moved_s: float | None = None


@dataclass
class Counters:
    """What the scheduler counts that nothing else can see, for metrics and tests."""

    stale_outputs: int = 0  # outputs of runs no longer current, dropped
    kv_preemptions: int = 0  # bulk runs stopped because running sequences outgrew the KV cache
    late_refusals: int = 0  # interactive requests refused for want of a worker that could start them in time (opt-in)
