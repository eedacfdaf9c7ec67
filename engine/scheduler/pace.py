"""A worker's pace: what its speed is learnt from, and what it predicts.

Each step report teaches it two things. The engine's own step time (`estimator`: how long the engine
computed, by batch and prompt tokens) forecasts when a request would get its first token and when running
requests finish. The step period as streams see it (`cadence`: report to report while busy, which adds
the loop, the pipe and the frontend's share of the cores) is what step composition plans by, with three
corrections measured on the side: the period with one sequence decoding (`single_step_s`), the cost of a
prompt token (`prefill_token_s`), and how long planned steps really take against the line they were
planned by (`step_ratio`).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from tokenline.engine.scheduler.composition import PREFILL_SAMPLE_TOKENS, step_line
from tokenline.engine.scheduler.estimator import StepEstimator
from tokenline.engine.types import StepPlan, StepReport

# One step's period over its prediction, as learnt into `step_ratio` (a stall says little).
STEP_RATIO_MIN, STEP_RATIO_MAX = 0.5, 2.0
# How far one single-sequence step period moves `single_step_s`: one below it, and one above.
SINGLE_FALL, SINGLE_RISE = 0.3, 0.005
# The shortest single-sequence step a worker's own timing at start (WorkerSpec.single_step_s) is taken for what a
# stream alone sees. Its timing leaves out the pipe to the frontend and the frontend's share of a step, ~0.2 ms on
# a single sequence here: a few % of the default model's 11 ms on a CPU (timed 11.2, a stream alone 10.8 ms apart),
# but the tiny model timed 1.12 ms where a stream alone got 1.30, and far more on a loaded box; taken as is, its ITL
# target held streams back that its steps had room for. Below this the estimate is learnt from traffic alone.
TIMED_SINGLE_MIN_S = 0.005
# How far the measured single step may move from the one a worker's ITL targets are multiples of before they follow
# it (`target_single_s`): within it they stay what was named, so the noise of a worker's single steps (±8 % here)
# and the pipe's share of a lone stream's step do not move a promise; past it the worker really sped up or slowed.
TARGET_BAND = 0.10


def timed_single_step(single_step_s: float) -> float | None:
    """A worker's single step as it timed it at start, where that stands for what a stream alone sees; else None."""
    return single_step_s if single_step_s >= TIMED_SINGLE_MIN_S else None


@dataclass
class WorkerPace:
    estimator: StepEstimator  # the engine's step time
    # Its step period as its streams see it (report to report while busy): what step composition plans by.
    cadence: StepEstimator = field(default_factory=lambda: StepEstimator(0.05))
    # Its measured period with one sequence decoding: from the worker's own timing on its idle engine at start
    # (WorkerSpec.single_step_s, set by Scheduler.add_worker), then a moving average that falls fast and rises
    # slowly, so it sits at the fast end of their noise (±8 % here) — what a stream alone gets — rather than at
    # their mean; it still follows a worker that really slowed, over a few hundred steps. ITL targets are
    # multiples of it.
    single_step_s: float | None = None
    # The single step its ITL targets in single steps (`itl_target_steps`, `min_itl_target_steps`) are multiples of:
    # the one it timed alone at start (the one the start-up line names), held while `single_step_s` stays within
    # TARGET_BAND of it and moved to it when it leaves the band (`target_moved`, which the runtime logs). None (a
    # step too short to time, scheduler/core.py): the targets follow `single_step_s`. Before, they followed it
    # always, and it rises in traffic (a lone sequence's steps carry the pipe and the frontend): a server that named
    # 70.9 ms (3 × 23.6) kept 3 × a single step that its lone-sequence steps of 24-32 ms had pulled up, and 5 of 65
    # streams ended past 70.9 ms (bench mixed, 2026-12-07).
    target_single_s: float | None = None
    target_moved: bool = False  # the last report moved `target_single_s`
    # Its cost per prompt token, measured on steps that computed at least PREFILL_SAMPLE_TOKENS of
    # them (a moving average): the floor under the fitted one when steps are planned.
    prefill_token_s: float | None = None
    # Its step periods over what the planning line (composition.step_line) predicted for them, on
    # steps run while interactive streams were in (a moving average): plans are made in the line's
    # seconds, streams' allowances are in real ones.
    step_ratio: float = 1.0
    # What the plan of the step under way predicted (0: unplanned): a worker that steps on before its
    # report is read runs, from that report on, the plan it had.
    under_way_step_s: float = 0.0
    last_report_at: float = 0.0  # when its last step ended (the next one began)
    # When it last got work while idle: a step period never counts the idle time before (a prompt step after a
    # quiet minute would otherwise be taken for a minute-long step, and its prompt for a very slow one).
    woke_at: float = 0.0

    @classmethod
    def fresh(cls, step_prior_s: float, prefill_prior_s: float) -> WorkerPace:
        return cls(StepEstimator(step_prior_s, prefill_prior_s), StepEstimator(step_prior_s, prefill_prior_s))

    def restarted(self) -> WorkerPace:
        """The pace of this worker's replacement: what was fitted of its speed carries over; what is
        measured of the running engine (its single step, prompt cost, last report) starts again."""
        return WorkerPace(self.estimator, self.cadence, step_ratio=self.step_ratio)

    def observe(self, report: StepReport, now: float, *, busy: bool, plan: StepPlan) -> None:
        """One step report. `busy`: it had work since its last report, so report to report is one whole
        step period; `plan`: the plan the step ran under."""
        self.target_moved = False
        if busy and self.last_report_at and report.batch_size:
            period = max(now - max(self.last_report_at, self.woke_at), report.step_s)
            self.cadence.observe(report.batch_size, report.prefill_tokens, period)
            if report.batch_size == 1 and not report.prefill_tokens:
                self.single_step_s = self._single_after(period)
                self.target_moved = (self.target_single_s is not None
                                     and abs(self.single_step_s - self.target_single_s) > TARGET_BAND * self.target_single_s)
                if self.target_moved:
                    self.target_single_s = self.single_step_s
            if report.prefill_tokens >= PREFILL_SAMPLE_TOKENS:  # enough prompt in it to tell its cost from noise
                a, b, _ = step_line(self.cadence, self.single_step_s, report.batch_size)
                per_token = max(period - (a + b * report.batch_size), 0.0) / report.prefill_tokens
                self.prefill_token_s = per_token if self.prefill_token_s is None else 0.8 * self.prefill_token_s + 0.2 * per_token
            if plan.limits:  # a planned step: how long such steps really take against the line they are planned by
                a, b, c = self.line(report.batch_size)
                predicted = a + b * report.batch_size + c * report.prefill_tokens
                if predicted > 0:
                    ratio = min(max(period / predicted, STEP_RATIO_MIN), STEP_RATIO_MAX)
                    self.step_ratio = 0.8 * self.step_ratio + 0.2 * ratio
        self.last_report_at = now
        self.under_way_step_s = plan.predicted_step_s
        self.estimator.observe(report.batch_size, report.prefill_tokens, report.step_s)

    def _single_after(self, period: float) -> float:
        if self.single_step_s is None:
            return period
        weight = SINGLE_FALL if period < self.single_step_s else SINGLE_RISE
        return (1.0 - weight) * self.single_step_s + weight * period

    def single(self) -> float:
        """Its period with one sequence decoding: measured, or the planning line's at batch 1 until then."""
        return self.single_step_s if self.single_step_s is not None else self.cadence.step_s(1)

    def target_single(self) -> float:
        """The single step its ITL targets in single steps are multiples of (`target_single_s`, else `single()`)."""
        return self.target_single_s if self.target_single_s is not None else self.single()

    def line(self, batch: int) -> tuple[float, float, float]:
        """The planning line (fixed, per sequence, per prompt token) around a batch of `batch` (composition.step_line)."""
        return step_line(self.cadence, self.single_step_s, batch, self.prefill_token_s)

    def first_token_at(self, now: float, running: int, owed_prompt_tokens: int) -> float:
        """When a request joining a batch of `running` gets its first token, with `owed_prompt_tokens` (its
        own included) to compute first: the start of its next step (mid-step, the one after), then a step
        with it in."""
        est = self.estimator
        start = now
        if running and self.last_report_at < now:  # mid-step: it joins the step after this one
            start = max(now, self.last_report_at + est.step_s(running))
        return start + est.first_token_s(running + 1, owed_prompt_tokens)
