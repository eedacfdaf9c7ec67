"""Scheduler settings: frozen dataclasses, validated when built."""

from __future__ import annotations

from dataclasses import dataclass, field

from tokenline.engine.flagspec import flag
from tokenline.engine.types import TrafficClass


@dataclass(frozen=True)
class ClassConfig:
    """Limits and batching rule of one traffic class (per model)."""

    admission_window_s: float = flag(0.0, "--{cls}-window-ms", "admission window, {cls}: how long the oldest "
                                     "request may wait to be batched with others", unit="ms")
    max_queued_requests: int = flag(1024, "--queue-requests", "queued requests per class")
    max_queued_tokens: int = flag(1_000_000, "--queue-tokens", "queued tokens per class (prompt + max new tokens)")
    max_attempts: int = flag(3, "--max-attempts", "attempts per request across worker crashes")
    # Latency targets (None: none). While a class with an ITL target has streams running, every
    # step of their worker is composed to be predicted within it (composition.py); while none
    # runs, steps compute prompts in chunks small enough that a newcomer still meets the TTFT
    # target (the TTFT guard).
    ttft_target_s: float | None = flag(
        None, "--{cls}-ttft-target-ms", "time to first token promised to {cls} streams: while none runs, a "
        "worker's steps compute prompts in chunks small enough that one arriving mid-step still meets it (the "
        "TTFT guard); 0: none", unit="ms", none_at_zero=True, only=("interactive",), type=float)
    itl_target_s: float | None = flag(
        None, "--{cls}-itl-target-ms", "time per output token promised to {cls} streams: while one runs, each step "
        "of its worker is composed (bulk sequences paused, prompts chunked) to be predicted within it; 2-3x the "
        "single-sequence step is a sensible value; 0: off", unit="ms", none_at_zero=True, only=("interactive",),
        type=float)
    # The TTFT target as a multiple of what an idle worker needs for a typical interactive prompt's first token
    # (one step of that prompt, by the worker's measured step line and prompt cost), never below
    # SchedulerConfig.ttft_target_floor_s (used when ttft_target_s is None): a target that follows the machine
    # and the model, as slow prompts on a slow CPU need more than a fast one.
    ttft_target_first_tokens: float | None = flag(
        None, "--{cls}-ttft-target-first-tokens", "the TTFT target as a multiple of an idle worker's first token "
        "for a typical {cls} prompt, as it measures it, and never below 500 ms (used when --{cls}-ttft-target-ms "
        "is 0; 0: off)", none_at_zero=True, only=("interactive",), type=float)
    # The ITL target as a multiple of the worker's own single-sequence step, as it measures it
    # (used when itl_target_s is None): a target that follows the machine.
    itl_target_steps: float | None = flag(
        None, "--{cls}-itl-target-steps", "the same target as a multiple of the worker's single-sequence step as "
        "it measures it, e.g. 2.5 (used when --{cls}-itl-target-ms is 0; 0: off)", none_at_zero=True,
        only=("interactive",), type=float)
    # Output tokens a second the class is to keep making, across all of a model's workers, while
    # the other class's ITL target holds steps short (bulk's goal; None: bulk only never starves).
    # Met at the interactive class's expense: fewer interactive streams run at once (the rest wait).
    throughput_goal_tok_s: float | None = flag(
        None, "--{cls}-goal-tok-s", "output tokens a second {cls} keeps making (all workers together) while "
        "interactive streams run under the ITL target: fewer interactive streams run at once (the others wait in "
        "the queue) so that steps within the target leave {cls} this much; 0: none, {cls} only never starves",
        none_at_zero=True, only=("bulk",), type=float)

    def ttft_target_for(self, idle_first_token_s: float, floor_s: float) -> float | None:
        if self.ttft_target_s is not None:
            return self.ttft_target_s
        if self.ttft_target_first_tokens is None:
            return None
        return max(self.ttft_target_first_tokens * idle_first_token_s, floor_s)

    @property
    def itl_target_in_steps(self) -> bool:
        """Is the ITL target a multiple of the worker's single-sequence step (not given in ms, not off)?"""
        return self.itl_target_s is None and self.itl_target_steps is not None

    def itl_target_for(self, single_step_s: float) -> float | None:
        if self.itl_target_s is not None:
            return self.itl_target_s
        return self.itl_target_steps * single_step_s if self.itl_target_steps is not None else None

    def __post_init__(self) -> None:
        if self.ttft_target_first_tokens is not None and self.ttft_target_first_tokens < 1:
            raise ValueError(f"ttft_target_first_tokens must be >= 1 (a first token cannot come sooner than an idle "
                             f"worker gives it), got {self.ttft_target_first_tokens}")
        if self.itl_target_steps is not None and self.itl_target_steps < 1:
            raise ValueError(f"itl_target_steps must be >= 1 (a step cannot be shorter than a single sequence's), got {self.itl_target_steps}")
        if self.throughput_goal_tok_s is not None and self.throughput_goal_tok_s <= 0:
            raise ValueError(f"throughput_goal_tok_s must be > 0 tokens a second (or None for no goal), got {self.throughput_goal_tok_s}")
        for name in ("ttft_target_s", "itl_target_s"):
            value = getattr(self, name)
            if value is not None and value <= 0:
                raise ValueError(f"{name} must be > 0 seconds (or None for no target), got {value}")
        if self.admission_window_s < 0:
            raise ValueError(f"admission_window_s must be >= 0, got {self.admission_window_s}")
        if self.max_queued_requests < 1:
            raise ValueError(f"max_queued_requests must be >= 1, got {self.max_queued_requests}")
        if self.max_queued_tokens < 1:
            raise ValueError(f"max_queued_tokens must be >= 1, got {self.max_queued_tokens}")
        if self.max_attempts < 1:
            raise ValueError(f"max_attempts must be >= 1, got {self.max_attempts}")


def model_name(key: str) -> str:
    """The name of the model a runtime key is a version of: "chat" for "chat" and "chat@3f2a…" alike."""
    return key.split("@", 1)[0]


@dataclass(frozen=True)
class TenantConfig:
    """A tenant's share and quotas."""

    weight: float = 1.0
    max_concurrent: int = 1_000_000  # queued + running requests, all models together
    max_queued_tokens: int = 1_000_000_000
    # Queued + running requests on one model (its every version and LoRA adapter), by model name: a tenant may be held
    # to a share of one model while free on another (the keys file's "models": {"chat": {"max_concurrent": 4}}).
    model_concurrent: tuple[tuple[str, int], ...] = ()

    def __post_init__(self) -> None:
        if self.weight <= 0:
            raise ValueError(f"tenant weight must be > 0, got {self.weight}")
        if self.max_concurrent < 1:
            raise ValueError(f"tenant max_concurrent must be >= 1, got {self.max_concurrent}")
        for model, limit in self.model_concurrent:
            if limit < 1:
                raise ValueError(f"tenant max_concurrent for model {model!r} must be >= 1, got {limit}")

    def concurrent_on(self, model: str) -> int | None:
        """The tenant's limit on the model named `model` (its runtime key's name), None if it has none of its own."""
        return next((limit for name, limit in self.model_concurrent if name == model), None)


@dataclass(frozen=True)
class SchedulerConfig:
    """Everything the scheduler decides by."""

    interactive: ClassConfig = flag(default_factory=ClassConfig, section=True)
    bulk: ClassConfig = flag(default_factory=lambda: ClassConfig(admission_window_s=0.02), section=True)
    # Share of each worker's sequence slots and KV blocks kept for bulk while
    # bulk is waiting, so that interactive traffic can never starve it.
    bulk_floor: float = flag(0.1, "--bulk-floor", "share of slots kept for waiting bulk")
    # KV blocks per worker never handed out (headroom for vLLM's own rounding).
    kv_watermark_blocks: int = 1
    # KV reserved for each running sequence beyond what it holds now: tokens it may add before the
    # scheduler next hears from its worker (reservations are re-counted at every step report).
    kv_margin_tokens: int = 16
    # Preempt running bulk sequences when interactive work cannot otherwise fit.
    preempt_bulk: bool = True
    # A bulk request is preempted at most this many times (each costs a re-prefill).
    max_preemptions: int = 3
    # Step time assumed before a worker has reported any (seconds).
    step_time_prior_s: float = 0.05
    # Prefill cost per prompt token assumed before measurements (seconds).
    prefill_per_token_prior_s: float = 0.0
    # Crashes of a worker a request was running on before it is isolated (runs alone, so that a
    # next crash names it). One crash alone blames no one: its innocent neighbours, and new work,
    # keep running together.
    isolate_after_crashes: int = 2
    # A crash's survivors never take the last clean worker of a model with several: they rerun on a worker
    # that leaves another free of crashed runs (so a poison among them cannot take every worker down and
    # newcomers always have one), waiting for the crashed worker's replacement if need be, but no longer
    # than this (a replacement that never comes must not hold them for ever).
    survivors_wait_s: float = 60.0
    # A request is quarantined when a worker dies while it runs alone (isolated), or after this
    # many crashes in all.
    quarantine_after_crashes: int = 3
    tenants: dict[str, TenantConfig] = field(default_factory=dict)
    default_tenant: TenantConfig = field(default_factory=TenantConfig)
    # Seconds of history used to estimate drain rate for retry hints.
    drain_window_s: float = 10.0
    # Step composition under an ITL target. What a stream is promised is its mean time per token
    # (GenerateRequest's ITL target), so each step is planned from the streams' own clocks: the
    # next step may take what keeps every interactive stream's mean, once that step's token comes,
    # at `itl_set_point` of its target (a stream behind its pace shortens the next step, one ahead
    # lets it run longer, never past half way from the set point to the target). Errors of the step-time model and of a
    # noisy box are paid back by the following steps of the same streams, so the set point only has
    # to cover the last step's error spread over a stream's tokens. (A share of the target learnt from
    # finished streams, as before, kept the median stream at 0.91 × T and bulk at 0.85-0.94 of its
    # bound at T = 2 single steps on the default model.) Admission plans interactive streams at it too.
    itl_set_point: float = 0.97
    # The TTFT guard's own margin: while no interactive stream runs, a step's prompt tokens are capped so that a
    # newcomer arriving mid-step gets its first token within `ttft_set_point` of the TTFT target. Lower than the
    # ITL set point: a first token has no later steps to pay an error back, and its wait adds the frontend's hops.
    ttft_set_point: float = 0.8
    # The least TTFT target a multiple of the idle first token (ClassConfig.ttft_target_first_tokens) gives:
    # tighter buys a caller nothing the frontend's own hops would not eat, and costs bulk its prompt chunks.
    ttft_target_floor_s: float = 0.5
    # An interactive request that cannot get its first token within its TTFT target: "admit" lets one the ITL target
    # has no room for in anyway once it has waited as long as that target allows (the running streams' steps slow
    # down); "refuse" admits none whose first token is forecast past its target, and answers RESOURCE_EXHAUSTED with
    # a retry hint once no worker could serve it in time, so that the caller can go elsewhere. Only a new request
    # with nothing delivered yet is refused (rules.late_refused), never one a prompt too long alone makes late.
    late_interactive: str = flag("admit", "--late-interactive", "an interactive request no worker can give its "
                                 "first token within the TTFT target: admit it anyway once it has waited that long "
                                 "(the running streams slow down), or refuse it then with a retry hint",
                                 choices=("admit", "refuse"))
    # Let at least this many bulk sequences decode in every step, so that bulk never starves
    # while interactive streams run.
    min_bulk_decode: int = 1
    # A request's own ITL target (GenerateRequest.itl_target_ms) is never taken tighter than this
    # many single-sequence steps of its worker: no one request may pause bulk work harder.
    min_itl_target_steps: float = 2.0

    def __post_init__(self) -> None:
        if not 0.0 <= self.bulk_floor < 1.0:
            raise ValueError(f"bulk_floor must be in [0, 1), got {self.bulk_floor}")
        if self.kv_watermark_blocks < 0:
            raise ValueError(f"kv_watermark_blocks must be >= 0, got {self.kv_watermark_blocks}")
        if self.kv_margin_tokens < 1:
            raise ValueError(f"kv_margin_tokens must be >= 1 (every step adds a token to each sequence), got {self.kv_margin_tokens}")
        if self.step_time_prior_s <= 0:
            raise ValueError(f"step_time_prior_s must be > 0, got {self.step_time_prior_s}")
        if not 0.0 < self.itl_set_point <= 1.0:
            raise ValueError(f"itl_set_point must be in (0, 1], got {self.itl_set_point}")
        if not 0.0 < self.ttft_set_point <= 1.0:
            raise ValueError(f"ttft_set_point must be in (0, 1], got {self.ttft_set_point}")
        if self.min_itl_target_steps < 1:
            raise ValueError(f"min_itl_target_steps must be >= 1 (a step cannot be shorter than a single sequence's), got {self.min_itl_target_steps}")
        if self.late_interactive not in ("admit", "refuse"):
            raise ValueError(f"late_interactive must be 'admit' or 'refuse', got {self.late_interactive!r}")
        if self.min_bulk_decode < 0:
            raise ValueError(f"min_bulk_decode must be >= 0, got {self.min_bulk_decode}")
        if self.isolate_after_crashes < 1:
            raise ValueError(f"isolate_after_crashes must be >= 1, got {self.isolate_after_crashes}")
        if self.quarantine_after_crashes < self.isolate_after_crashes:
            raise ValueError(f"quarantine_after_crashes ({self.quarantine_after_crashes}) must be >= "
                             f"isolate_after_crashes ({self.isolate_after_crashes})")

    def for_class(self, cls: TrafficClass) -> ClassConfig:
        return self.interactive if cls == TrafficClass.INTERACTIVE else self.bulk

    def for_tenant(self, tenant: str) -> TenantConfig:
        return self.tenants.get(tenant, self.default_tenant)
