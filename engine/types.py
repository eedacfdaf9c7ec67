"""Plain domain data shared by the frontend, the scheduler and the workers.

Nothing here imports grpc, vllm or torch: these records cross the process
boundary to workers (pickled) and are what the scheduler reasons about.

Glossary: one name per thing, from the caller to vLLM.
- request: what a caller asked for (GenerateRequest); its key is the pair (tenant, request id)
  (server/request.py RequestKey), written as JSON where it must be a string. A request has one or more runs.
- run: one admission of a request to a worker; its run key is "<request key>@<run number>"
  (records.Entry.run_key): the key a WorkItem and a SeqOutput carry, and vLLM's request id (plus vLLM's suffix).
- attempt: how many times the request was started over after a worker was lost (a crash, a hung worker); a
  preemption is a new run of the same attempt. Either way it continues from the tokens delivered so far
  (WorkItem.delivered_tokens).
- sample: one of n outputs of a request (n > 1), each its own request key with a sample index.
- entry: the scheduler's record of a request (records.Entry): queued, running on a worker, or ended.
- class: interactive or bulk (TrafficClass); each has its own queue, admission window and targets.
- admission: the scheduler's decision to start a run on a worker (records.Admission), taken in a dispatch round
  (core.py `_dispatch`, its rules in rules.py DispatchRules). One name per action, from the scheduler to the worker:
  the scheduler's Admit action carries a worker's admissions and the worker receives them as one Admit message
  (its WorkItems, a batch numbered `seq`); the scheduler's Abort action (cancelled, expired, preempted) reaches the
  worker as an Abort message; SetPlan carries a StepPlan, which the worker receives as is. The actions live in
  engine/scheduler/records.py, the messages here; the runtime imports the messages as `wire`.
- step: one engine step of a worker: every running sequence advances (a token, or a chunk of its prompt);
  its StepReport says what it did. Step period: report to report as the streams see it (the pace).
- step plan: how a worker composes its steps while interactive sequences run (StepPlan); the scheduler's
  SetPlan action carries it, the backend applies it (engine/backend.py set_plan).
- pace: what the scheduler has learnt of a worker's speed (engine/scheduler/pace.py WorkerPace).
- slots: the sequences a worker runs at once. WorkerConfig.max_seqs counts those bulk may fill;
  interactive_slots are only interactive's; the engine runs both: WorkerConfig.engine_seqs, which the worker
  reports as WorkerSpec.engine_seqs.
- step report: a worker's StepReport. The Supervisor hands it on (on_report) to the runtime, which gives it to
  Scheduler.on_step (the one `on_step`); what the scheduler read from it (StepResult) goes to the runtime's
  step_hooks (the step log, Telemetry.record_step). The watchdog only hears that a step came (saw_step).
"""

from __future__ import annotations

import enum
import operator
from dataclasses import dataclass, field, fields


class TrafficClass(enum.IntEnum):
    """Who is waiting: values match tokenline.v1.TrafficClass."""

    INTERACTIVE = 1
    BULK = 2


class FinishReason(enum.IntEnum):
    """Why generation stopped: values match tokenline.v1.FinishReason."""

    STOP = 1
    LENGTH = 2
    STOP_STRING = 3
    CANCELLED = 4
    DEADLINE = 5


# The log-probability of one token: (token id, logprob, rank from 1, the token's text).
TokenLogprob = tuple[int, float, int, str]
# At one position: the token there, and the most likely tokens (most likely first).
PositionLogprobs = tuple[TokenLogprob, tuple[TokenLogprob, ...]]

STRUCTURED_FORMATS = ("json_schema", "json_object", "regex", "choice", "grammar")


@dataclass(frozen=True)
class Sampling:
    """Validated sampling settings (see SamplingParams in the proto).

    Plain values and tuples only: it crosses to workers pickled, is stored as JSON by the job
    store (`from_dict` reads it back), and its repr is part of a request's fingerprint, so two
    requests that differ in any field are different work.
    """

    max_tokens: int = 64
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    ignore_eos: bool = False
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    min_tokens: int = 0
    stop_token_ids: tuple[int, ...] = ()
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, bias), by token id
    include_stop_str_in_output: bool = False
    logprobs: int | None = None  # alternatives per output token (0: the chosen token's only); None: none
    prompt_logprobs: int | None = None
    # Structured output: one of STRUCTURED_FORMATS and its text (a JSON schema, a regex, a grammar,
    # the choices as a JSON list; "" for json_object), or ("", "") for free text.
    structured: tuple[str, str] = ("", "")

    @classmethod
    def from_dict(cls, values: dict) -> "Sampling":
        """The inverse of dataclasses.asdict after a JSON round trip (lists back to tuples)."""
        values = dict(values)
        for name in ("stop", "stop_token_ids", "structured"):
            if name in values:
                values[name] = tuple(values[name])
        if "logit_bias" in values:
            values["logit_bias"] = tuple((int(t), float(b)) for t, b in values["logit_bias"])
        return cls(**values)

    @property
    def penalised(self) -> bool:
        """Presence or frequency penalties: they count the output so far, which a continuation must carry."""
        return bool(self.presence_penalty or self.frequency_penalty)


@dataclass(frozen=True)
class WorkItem:
    """One run of one request (an admission: a new attempt, or a preempted run resumed), as a
    worker runs it.

    `prompt_token_ids` already includes tokens generated by earlier runs,
    and `sampling.max_tokens` counts only the tokens still owed, so a run
    continues where the last one stopped.
    """

    key: str  # the run key, unique per run: "<request key>@<run>" (scheduler records.py, Entry.run_key)
    prompt_token_ids: tuple[int, ...]
    sampling: Sampling
    priority: int = 0  # lower runs first (vLLM priority scheduling)
    fault_marker: bool = False  # set only when fault injection is on
    # A continuation: the last `delivered_tokens` of the prompt are this request's own output from
    # earlier attempts, of whose text the caller has been shown the first `shown_chars` characters.
    # The rest (held back while it could begin a stop string) comes first in this attempt's text.
    delivered_tokens: int = 0
    shown_chars: int = 0
    # Prompt log-probabilities already delivered (by an earlier attempt): not computed again.
    prompt_logprobs_sent: bool = False
    # A LoRA adapter of the worker's model (WorkerConfig.lora_adapters): (name, id, folder); None: the base model.
    # Every run of a request carries its request's, so a continuation runs on the same weights. A worker that has
    # not loaded it (an adapter loaded through the admin service after the worker started) loads it from the folder.
    lora: tuple[str, int, str] | None = None


@dataclass(frozen=True)
class StepPlan:
    """How a worker composes its steps; None means no limit.

    Decided by the scheduler (engine/scheduler/composition.py), carried out by the backend. While
    an interactive sequence is in the engine: every interactive sequence decodes, at most
    `bulk_decode` bulk sequences decode (the others pause and keep their KV), and at most
    `prefill_tokens` prompt tokens are computed, interactive prompts first, and past
    `budget_prefill_tokens` only for interactive prompts still owed (see `prefill_budget`). With none in, the
    backend decides this itself each step (the plan may lag): every sequence decodes and only
    `guard_prefill_tokens` caps the prompt tokens of a step (the TTFT guard: a step an interactive
    arrival may have to wait for stays short), so bulk gets the machine the moment interactive
    traffic ends.
    """

    bulk_decode: int | None = None
    prefill_tokens: int | None = None
    predicted_step_s: float = 0.0  # the scheduler's forecast of a step run to this plan (0: no plan)
    guard_prefill_tokens: int | None = None  # with no interactive sequence in: prompt tokens per step at most
    budget_prefill_tokens: int | None = None  # of prefill_tokens, what the streams' step budget alone allows

    @property
    def limits(self) -> bool:
        return self.bulk_decode is not None or self.prefill_tokens is not None

    @property
    def worker_limits(self) -> tuple[int | None, ...]:
        """What the worker applies (all but the forecast): a plan that moves none of these need not be sent."""
        return self.bulk_decode, self.prefill_tokens, self.guard_prefill_tokens, self.budget_prefill_tokens

    def prefill_budget(self, interactive_owed: int) -> int | None:
        """The prompt tokens a step may compute, given the interactive prompt tokens the worker still owes now.

        A plan may ask for more prompt tokens than the streams' step budget allows, for an interactive prompt
        whose first token is due (the TTFT target) or for a chunk's minimum. But the scheduler sees no prompt's
        progress (a prompt counts as owed whole until its first token), and its plan reaches the worker a step
        or more after the report it was made from: the prompt may be done by then. What it no longer needs is
        not handed to bulk prompts, which would make the step as long as the plan allowed for the first token
        (measured, bench mixed at 2.5 x: steps of 65-130 prompt tokens, 114-218 ms against a 62.7 ms target,
        the step after nearly every interactive first token). Bulk prompts get what the step budget allows."""
        if self.prefill_tokens is None or self.budget_prefill_tokens is None:
            return self.prefill_tokens
        return min(self.prefill_tokens, max(self.budget_prefill_tokens, interactive_owed))


@dataclass(frozen=True)
class WorkerSpec:
    """What a worker can hold, sent once when it is ready."""

    worker_id: int
    model: str
    model_version: str
    kv_blocks_total: int
    block_size: int
    engine_seqs: int  # sequences it runs at once, interactive_slots included (WorkerConfig.engine_seqs)
    max_model_len: int
    prefill_token_budget: int
    vocab_size: int
    eos_token_id: int | None
    pid: int = 0
    # Of engine_seqs, the slots bulk may not take (WorkerConfig.interactive_slots): held for interactive
    # streams, so that one arriving needs no bulk preempted for its slot.
    interactive_slots: int = 0
    continuous: bool = True  # False: a batch runs to completion before the next is admitted
    dtype: str = ""  # the dtype the model runs in
    attention_kernel: str = ""  # the CPU attention kernel ("vec", "amx", ...), or the engine's backend
    # How the model's forward pass runs: "compiled" or "eager" (WorkerConfig.compile).
    execution: str = ""
    # It starts its next step as soon as it has reported, before the frontend has read the report
    # (engine/worker.py StepLoop): what is admitted on a report lands in the step after next.
    runs_ahead: bool = False
    self_check: str = ""  # the verdict of the model self-check against the float32 reference
    # A step computing a whole prefill budget, as the worker timed one while it loaded (its
    # self-check's first step, scaled to the budget; 0: not measured): the watchdog's scale before
    # the worker has reported steps of its own.
    full_step_s: float = 0.0
    # One sequence decoding alone: its step period, as the worker timed it on its idle engine before taking work
    # (vllm_build.time_single_step; 0: not timed). The scheduler starts the worker's single step from it
    # (scheduler/pace.py), which default ITL targets are multiples of: learnt only from live traffic, it was what
    # batch-1 steps cost beside a load generator's first requests, and under a saturated mix it never relearnt.
    single_step_s: float = 0.0


@dataclass
class SeqOutput:
    """What one step produced for one sequence."""

    key: str
    new_token_ids: list[int]
    text: str
    finished: bool = False
    finish_reason: FinishReason | None = None
    prompt_tokens: int = 0
    logprobs: list[PositionLogprobs] | None = None  # one per new token, when the request asked
    prompt_logprobs: list[PositionLogprobs] | None = None  # with the first output, when asked
    cached_tokens: int | None = None  # with the first output: prompt tokens found in the prefix cache

    def __reduce__(self) -> tuple:
        # Pickled as its fields in order, not as a dict of them: a report carries one per sequence, and this
        # unpickles in about a quarter of the time on the frontend's loop (issue 38).
        return SeqOutput, _seq_output_fields(self)


_seq_output_fields = operator.attrgetter(*(f.name for f in fields(SeqOutput)))


@dataclass
class StepReport:
    """One report per worker step: outputs, timing and the budget left."""

    worker_id: int
    applied_seq: int  # highest admission batch applied before this step
    step_s: float  # wall time of the engine step
    batch_size: int  # sequences in the step
    prefill_tokens: int  # prompt tokens computed in the step
    kv_blocks_free: int
    running: int
    waiting: int
    outputs: list[SeqOutput] = field(default_factory=list)
    first_scheduled: list[str] = field(default_factory=list)  # keys scheduled for the first time
    aborted: list[str] = field(default_factory=list)  # keys the worker dropped (abort applied)
    # Keys the engine refused or failed (prompt too long, token out of vocabulary, engine error),
    # with a reason fit to show the caller; such an item produces no further output.
    rejected: dict[str, str] = field(default_factory=dict)
    paused: int = 0  # running bulk sequences held back this step by the step plan (their KV kept)
    # Prompt tokens of admitted requests the engine cannot schedule yet: their structured-output format is
    # still compiling. Still owed: a step that ran without them is no sign the worker has room for more.
    stalled_prompt_tokens: int = 0
    # The step plan this step ran under, as the worker applied it (a plan sent after a report takes effect a
    # step or more later): its bulk decode limit (None: no limit applied this step), and the bulk sequences
    # that decoded a token in the step, so that a log shows the limit held.
    plan_bulk_decode: int | None = None
    bulk_decoded: int = 0


# Messages from the frontend to a worker.
@dataclass(frozen=True)
class Admit:
    seq: int
    items: tuple[WorkItem, ...]


@dataclass(frozen=True)
class Abort:
    keys: tuple[str, ...]


@dataclass(frozen=True)
class AdapterChange:
    """The model's LoRA adapters changed (the admin service, server/admin.py): load `add` ((name, folder, id) each)
    now, so that the first request naming one does not wait for it, and remove the adapters `drop` names (by id) from
    the engine, freeing their slots. A worker that started later has the change in its WorkerConfig."""

    add: tuple[tuple[str, str, int], ...] = ()
    drop: tuple[int, ...] = ()


@dataclass(frozen=True)
class Shutdown:
    pass


@dataclass(frozen=True)
class WorkerFailed:
    """Sent by a worker that could not start (bad model, out of memory)."""

    worker_id: int
    message: str
