"""A simulated engine behind the Backend interface: vLLM's shape, a cost model's speed.

It schedules like vLLM (continuous batching, chunked prefill under a token
budget, KV blocks allocated as sequences grow, recompute preemption of the
least urgent sequence when blocks run out) and takes, per step, what its
`StepCost` says (the cost model virtual-time simulation uses too), spent in an
injectable sleep. Tokens are a deterministic function of the prompt, so
runs repeat exactly. With `sim_fixed_batch` it is a static-batching server
instead: a batch is formed only when the worker is empty and all its
sequences are reported finished together when its longest one ends.

No vllm or torch here; text comes from the model folder's tokenizer.json
when there is one (via the `tokenizers` library), else " t<id>" per token.
"""
# Over 400 lines: a whole engine (scheduling, KV blocks, preemption, tokens, text with stop strings) in one place.

from __future__ import annotations

import hashlib
import itertools
import math
import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tokenline.engine import modelconfig
from tokenline.engine.config import WorkerConfig
from tokenline.engine.types import FinishReason, SeqOutput, StepPlan, StepReport, WorkerSpec, WorkItem

_DEFAULT_VOCAB = 32000
_DEFAULT_KV_BYTES_PER_TOKEN = 16 * 1024
_COMMIT_EVERY = 32  # decode text in windows of this many tokens, so a step costs O(window), not O(length)


@dataclass(frozen=True)
class StepCost:
    """The simulated engine's step time, in seconds: `base + per_seq * batch + per_prefill_token * prefill`.

    One cost model for both simulations: this backend (a worker process, real time) and the
    virtual-time workers of engine/simulation.py.
    """

    base_s: float
    per_seq_s: float = 0.0
    per_prefill_token_s: float = 0.0

    def __call__(self, batch: int, prefill_tokens: int) -> float:
        return self.base_s + self.per_seq_s * batch + self.per_prefill_token_s * prefill_tokens

    @classmethod
    def of(cls, config: WorkerConfig) -> StepCost:
        return cls(config.sim_step_base_s, config.sim_step_per_seq_s, config.sim_prefill_per_token_s)


class SimModel:
    """What the simulator knows of a model folder: vocabulary, eos, context length, KV size, text."""

    def __init__(self, model_path: str):
        folder = Path(model_path)
        hf = modelconfig.read_config(folder)
        self.tokenizer = _load_tokenizer(folder / "tokenizer.json")
        vocab = self.tokenizer.get_vocab_size() if self.tokenizer is not None else hf.get("vocab_size")
        self.vocab_size = int(vocab or _DEFAULT_VOCAB)
        eos = hf.get("eos_token_id")
        self.eos_token_id = eos[0] if isinstance(eos, list) and eos else eos
        self.context_len = int(hf.get("max_position_embeddings") or 1 << 30)
        self.kv_bytes_per_token = modelconfig.kv_bytes_per_token(hf) or _DEFAULT_KV_BYTES_PER_TOKEN

    def decode(self, ids: list[int]) -> str:
        if self.tokenizer is not None:
            return self.tokenizer.decode(ids, skip_special_tokens=True)
        return "".join(f" t{i}" for i in ids if i != self.eos_token_id)


@dataclass(eq=False)
class _Seq:
    item: WorkItem
    order: int  # arrival order: ties in priority go first-come-first-served
    digest: int  # fixes the tokens this sequence will produce
    natural_len: int | None  # tokens until it emits eos; None: never
    output_ids: list[int] = field(default_factory=list)
    computed: int = 0  # tokens whose KV is in the cache
    blocks: int = 0
    scheduled_once: bool = False
    finish_reason: FinishReason | None = None  # set when it stops generating
    text_committed: str = ""
    text_commit_at: int = 0  # output tokens covered by text_committed
    text_emitted: int = 0  # characters of text already reported
    text_final: str | None = None

    @property
    def tokens(self) -> int:  # prompt + generated: what a recompute must prefill
        return len(self.item.prompt_token_ids) + len(self.output_ids)

    @property
    def urgency(self) -> tuple[int, int]:
        return (self.item.priority, self.order)


def _prompt_owed(seq: _Seq) -> int:
    """Prompt tokens `seq` has still to compute (0 once it decodes)."""
    return 0 if seq.output_ids and seq.computed >= seq.tokens - 1 else seq.tokens - seq.computed


class SimBackend:
    def __init__(self, config: WorkerConfig, worker_id: int, *, sleep: Callable[[float], Any] = time.sleep):
        self.config = config
        self.worker_id = worker_id
        self.sleep = sleep
        self.cost = StepCost.of(config)
        self.model = SimModel(config.model_path)
        self.max_model_len = min(config.max_model_len, self.model.context_len)
        self.kv_blocks_total = max(1, config.kv_cache_bytes // (config.block_size * self.model.kv_bytes_per_token))
        self.free_blocks = self.kv_blocks_total
        self.waiting: list[_Seq] = []
        self.running: list[_Seq] = []
        self._order = itertools.count()
        self._aborted: list[str] = []
        self._rejected: dict[str, str] = {}
        self.plan = StepPlan()
        self._paused = 0  # bulk sequences the plan held back in the last step
        self._applied_bulk_decode: int | None = None  # the plan's bulk limit, when it applied to the last step

    def spec(self) -> WorkerSpec:
        return WorkerSpec(
            worker_id=self.worker_id,
            model=self.config.model_name,
            model_version=self.config.model_version or _model_version(self.config.model_path),
            kv_blocks_total=self.kv_blocks_total,
            block_size=self.config.block_size,
            engine_seqs=self.config.engine_seqs,
            interactive_slots=self.config.interactive_slots,
            max_model_len=self.max_model_len,
            prefill_token_budget=self.config.prefill_token_budget,
            vocab_size=self.model.vocab_size,
            eos_token_id=self.model.eos_token_id,
            pid=os.getpid(),
            continuous=not self.config.sim_fixed_batch,
        )

    # ------------------------------------------------------------------ inbox

    def add(self, item: WorkItem) -> None:
        problem = self._check(item)
        if problem:
            self._rejected[item.key] = problem
            return
        digest = _digest(item)
        natural = None
        if not item.sampling.ignore_eos and self.model.eos_token_id is not None:
            natural = 16 + digest % 240
        self.waiting.append(_Seq(item, next(self._order), digest, natural))

    def abort(self, keys: tuple[str, ...]) -> None:
        wanted = set(keys)
        for queue in (self.waiting, self.running):
            for seq in [s for s in queue if s.item.key in wanted]:
                queue.remove(seq)
                self._free(seq)
                self._aborted.append(seq.item.key)

    def set_plan(self, plan: StepPlan) -> None:
        self.plan = plan

    def has_work(self) -> bool:
        return bool(self.waiting or self.running or self._aborted or self._rejected)

    # ------------------------------------------------------------------- step

    def step(self) -> StepReport:
        if self.config.sim_fixed_batch:
            batch, prefill = self._schedule_fixed()
        else:
            batch, prefill = self._schedule_continuous()
        step_s = 0.0
        if batch:
            step_s = self.cost(len(batch), sum(prefill.values()))
            self.sleep(step_s)
        first = [s.item.key for s in batch if not s.scheduled_once]
        for seq in batch:
            seq.scheduled_once = True
        outputs = self._postprocess(batch, prefill)
        report = StepReport(
            worker_id=self.worker_id,
            applied_seq=0,
            step_s=step_s,
            batch_size=len(batch),
            prefill_tokens=sum(prefill.values()),
            kv_blocks_free=self.free_blocks,
            running=len(self.running),
            waiting=len(self.waiting),
            outputs=outputs,
            first_scheduled=first,
            aborted=self._aborted,
            rejected=self._rejected,
            paused=self._paused,
            plan_bulk_decode=self._applied_bulk_decode,
            bulk_decoded=sum(1 for seq in batch if seq.item.priority != 0 and seq.item.key not in prefill),
        )
        self._aborted, self._rejected = [], {}
        return report

    def _schedule_continuous(self) -> tuple[list[_Seq], dict[str, int]]:
        """Decodes first, then prompt chunks under the token budget; preempt when blocks run out."""
        batch: list[_Seq] = []
        prefill: dict[str, int] = {}
        budget = self.config.prefill_token_budget
        running = sorted(self.running, key=lambda s: s.urgency)
        running, budget = self._compose(running, budget)
        for seq in running:
            if seq not in self.running:  # preempted for a more urgent one in this loop
                continue
            chunk = min(seq.tokens - seq.computed, budget)
            while not self._grow(seq, seq.computed + chunk):
                victim = max(self.running, key=lambda s: s.urgency)
                self._preempt(victim)
                if victim is seq:
                    break
            else:
                batch.append(seq)
                budget -= chunk
                if not (seq.output_ids and seq.computed == seq.tokens - 1):  # not a decode
                    prefill[seq.item.key] = chunk
            if budget <= 0:
                break
        self.waiting.sort(key=lambda s: s.urgency)
        while self.waiting and budget > 0 and len(self.running) < self.config.engine_seqs:
            seq = self.waiting[0]
            chunk = min(seq.tokens, budget)
            if not self._grow(seq, chunk):
                break
            self.waiting.pop(0)
            self.running.append(seq)
            batch.append(seq)
            prefill[seq.item.key] = chunk
            budget -= chunk
        return batch, prefill

    def _compose(self, running: list[_Seq], budget: int) -> tuple[list[_Seq], int]:
        """The step plan, carried out as the vLLM worker does: while an interactive sequence is in,
        only the first `bulk_decode` bulk sequences run (the rest pause, keeping their KV) and the
        step computes at most `prefill_tokens` prompt tokens besides one token per sequence; with
        none in, every sequence runs and at most `guard_prefill_tokens` prompt tokens are computed."""
        self._paused = 0
        self._applied_bulk_decode = None
        plan = self.plan
        if not any(s.item.priority == 0 for s in itertools.chain(running, self.waiting)):
            if plan.guard_prefill_tokens is not None:  # no interactive sequence: only the TTFT guard
                budget = min(budget, len(running) + plan.guard_prefill_tokens)
                decoding = [s for s in running if s.computed >= len(s.item.prompt_token_ids)]
                running = decoding + [s for s in running if s not in decoding]  # decodes before prompt chunks
            return running, budget
        if not plan.limits:
            return running, budget
        bulk = [s for s in running if s.item.priority != 0]
        decoding = [s for s in bulk if s.computed >= len(s.item.prompt_token_ids)]
        keep = decoding if plan.bulk_decode is None else decoding[:plan.bulk_decode]
        if not any(s.item.priority == 0 for s in self.waiting):  # a part-prefilled bulk prompt waits while an interactive one does
            keep = keep + [s for s in bulk if s not in decoding]
        paused = set(bulk) - set(keep)
        running = [s for s in running if s not in paused]
        self._applied_bulk_decode = plan.bulk_decode
        self._paused = len(paused)
        if plan.prefill_tokens is not None:
            owed = sum(_prompt_owed(s) for s in itertools.chain(running, self.waiting) if s.item.priority == 0)
            budget = min(budget, len(running) + plan.prefill_budget(owed))
        return running, budget

    def _schedule_fixed(self) -> tuple[list[_Seq], dict[str, int]]:
        """A new batch only when the last one is done: whole prompts at once, KV reserved to the end."""
        prefill: dict[str, int] = {}
        if not self.running:
            self.waiting.sort(key=lambda s: s.urgency)
            while self.waiting and len(self.running) < self.config.engine_seqs:
                seq = self.waiting[0]
                if not self._grow(seq, min(seq.tokens + seq.item.sampling.max_tokens, self.max_model_len)):
                    break
                self.running.append(self.waiting.pop(0))
                prefill[seq.item.key] = seq.tokens
        return list(self.running), prefill

    def _postprocess(self, batch: list[_Seq], prefill: dict[str, int]) -> list[SeqOutput]:
        new_ids: dict[str, list[int]] = {}
        for seq in batch:
            seq.computed += prefill.get(seq.item.key, 1 if seq.finish_reason is None else 0)
            if seq.finish_reason is None and seq.computed >= seq.tokens:
                new_ids[seq.item.key] = [self._next_token(seq)]
                seq.output_ids.extend(new_ids[seq.item.key])
                seq.finish_reason = self._stop_check(seq)
        # A static batch ends together: its sequences are reported finished when the longest ends.
        ending = [s for s in batch if s.finish_reason is not None]
        if self.config.sim_fixed_batch and any(s.finish_reason is None for s in self.running):
            ending = []
        outputs = []
        for seq in batch:
            ids, done = new_ids.get(seq.item.key, []), seq in ending
            text = self._new_text(seq) + (self._flush_text(seq) if done else "")
            if ids or text or done:
                outputs.append(
                    SeqOutput(
                        key=seq.item.key,
                        new_token_ids=ids,
                        text=text,
                        finished=done,
                        finish_reason=seq.finish_reason if done else None,
                        prompt_tokens=len(seq.item.prompt_token_ids),
                    )
                )
        for seq in ending:
            self._retire(seq)
        return outputs

    # ---------------------------------------------------------------- tokens

    def _next_token(self, seq: _Seq) -> int:
        position = len(seq.output_ids)
        if seq.natural_len is not None and position == seq.natural_len - 1:
            return self.model.eos_token_id
        token = _mix(seq.digest, position) % self.model.vocab_size
        if token == self.model.eos_token_id:
            token = (token + 1) % self.model.vocab_size
        return token

    def _stop_check(self, seq: _Seq) -> FinishReason | None:
        if seq.output_ids[-1] == self.model.eos_token_id and not seq.item.sampling.ignore_eos:
            return FinishReason.STOP
        if seq.item.sampling.stop and self._find_stop(seq) is not None:
            return FinishReason.STOP_STRING
        if len(seq.output_ids) >= seq.item.sampling.max_tokens or seq.tokens >= self.max_model_len:
            return FinishReason.LENGTH
        return None

    def _text(self, seq: _Seq) -> str:
        if seq.text_final is not None:
            return seq.text_final
        tail = self.model.decode(seq.output_ids[seq.text_commit_at :])
        if len(seq.output_ids) - seq.text_commit_at >= _COMMIT_EVERY and not tail.endswith("\ufffd"):
            seq.text_committed += tail
            seq.text_commit_at = len(seq.output_ids)
            tail = ""
        return seq.text_committed + tail

    def _find_stop(self, seq: _Seq) -> int | None:
        text = self._text(seq)
        hits = [i for s in seq.item.sampling.stop if (i := text.find(s, max(0, seq.text_emitted - len(s)))) >= 0]
        if not hits:
            return None
        seq.text_final = text[: min(hits)]
        return min(hits)

    def _new_text(self, seq: _Seq) -> str:
        """Text that can no longer change: held back are a partial character and a possible stop-string prefix."""
        text = self._text(seq)
        end = len(text)
        if seq.finish_reason is None:
            end -= max((len(s) for s in seq.item.sampling.stop), default=1) - 1
            if text.endswith("\ufffd"):
                end = min(end, len(text) - 1)
        return self._emit(seq, text, end)

    def _flush_text(self, seq: _Seq) -> str:
        text = self._text(seq)
        return self._emit(seq, text, len(text))

    def _emit(self, seq: _Seq, text: str, end: int) -> str:
        if end <= seq.text_emitted:
            return ""
        new = text[seq.text_emitted : end]
        seq.text_emitted = end
        return new

    # ---------------------------------------------------------------- blocks

    def _grow(self, seq: _Seq, tokens: int) -> bool:
        need = math.ceil(tokens / self.config.block_size) - seq.blocks
        if need > self.free_blocks:
            return False
        if need > 0:
            self.free_blocks -= need
            seq.blocks += need
        return True

    def _free(self, seq: _Seq) -> None:
        self.free_blocks += seq.blocks
        seq.blocks = 0

    def _preempt(self, seq: _Seq) -> None:
        """Recompute preemption, as vLLM does: drop its KV, send it back to wait."""
        self.running.remove(seq)
        self._free(seq)
        seq.computed = 0
        self.waiting.append(seq)

    def _retire(self, seq: _Seq) -> None:
        self.running.remove(seq)
        self._free(seq)

    def _check(self, item: WorkItem) -> str | None:
        n = len(item.prompt_token_ids)
        if n == 0:
            return "the prompt is empty"
        if n > self.max_model_len:
            return f"the prompt has {n} tokens, more than this model's limit of {self.max_model_len}"
        if math.ceil(n / self.config.block_size) > self.kv_blocks_total:
            return f"the prompt needs more KV cache than this worker has ({self.kv_blocks_total} blocks)"
        if any(t < 0 or t >= self.model.vocab_size for t in item.prompt_token_ids):
            return f"the prompt has token ids outside the vocabulary (0..{self.model.vocab_size - 1})"
        s = item.sampling
        # The simulated model has no logits: what reads or constrains them is refused, never faked.
        if s.logprobs is not None or s.prompt_logprobs is not None or s.structured[0]:
            return "the simulated engine (--engine sim) computes no logits: logprobs and structured output need --engine vllm"
        return None


def _digest(item: WorkItem) -> int:
    h = hashlib.blake2b(digest_size=8)
    h.update(",".join(map(str, item.prompt_token_ids)).encode())
    if item.sampling.seed is not None and item.sampling.temperature > 0:
        h.update(f"seed={item.sampling.seed}".encode())
    return int.from_bytes(h.digest(), "little")


def _mix(digest: int, position: int) -> int:
    """A cheap, well-spread hash of (sequence, position)."""
    x = (digest ^ (position * 0x9E3779B97F4A7C15)) & 0xFFFFFFFFFFFFFFFF
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & 0xFFFFFFFFFFFFFFFF
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & 0xFFFFFFFFFFFFFFFF
    return x ^ (x >> 31)


def _load_tokenizer(path: Path) -> Any:
    if not path.is_file():
        return None
    try:
        from tokenizers import Tokenizer
    except ImportError:
        return None
    return Tokenizer.from_file(str(path))


def _model_version(model_path: str) -> str:
    if not Path(model_path).is_dir():
        return "sim"
    from tokenline.engine.models import model_version

    return model_version(Path(model_path))
