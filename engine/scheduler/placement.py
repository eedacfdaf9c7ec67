"""Where a call's samples go: together, on the worker the first of them went to, while it has room.

The n samples of one call (server/servicer.py `_run_samples`) are n requests with one prompt. On one worker the
prompt's full KV blocks are computed once and shared through vLLM's prefix cache; on two, each computes them. So
each sample's Entry carries its call's key (`Entry.group`), and when the dispatch round (core.py `_admit_class`)
places a sample, it takes the worker its group's first placed sample went to, in this round or an earlier one,
if that worker is among those that would take it now. A preference, never a wait: a sample whose group's worker
has no room goes where any request would (where its first token comes soonest), so it waits no longer than
without a group.

What it saves is charged as saved: on a worker that runs a sibling (admitted in this round or before), a sample's
prompt costs the step budget only what vLLM will compute of it, less the full blocks of the shared prompt that its
prefix cache holds (`cached_on`, read by the budget: budget.py; and `Entry.cached_prompt`, set when it is placed,
for what the worker still owes). Charged in full, a worker with a 512-token step budget took two 256-token samples
a step, the third went to the other worker, and the preference changed nothing: every call's four samples ran two
and two, as without it (measured in the simulator). Charged as saved, it took three, and the fourth still went to
the other worker whenever that one reported first: at saturation 53 of 64 calls ran on both workers (simulator).
So a sample beside a sibling rides with it past the step's prompt room and the dispatch rule (budget.py
`rides_with_sibling`): while the group's worker has a slot and KV for it, it goes there, and vLLM computes
its unshared tail in the worker's next step. The step room it overdraws is at most n - 1 unshared tails of
one call (a block or less each).

Every path that places a request goes through `placed` (Scheduler._take): a preempted sample re-admitted, a
crash's survivor placed by the crash rules (crashes.py, which keep their own choice of worker: it continues
from its delivered tokens wherever it lands). A group whose worker died, or was restarted (a new WorkerView
under the same id, with an empty prefix cache), has no preference until one of its samples is placed again.
Requests without a group (n = 1, jobs) are untouched. Pure bookkeeping over the Scheduler's state; the memory
is one row per group with a placed sample not yet forgotten.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from tokenline.engine.scheduler.records import Entry
from tokenline.engine.scheduler.state import WorkerView


class SiblingPlacement:
    def __init__(self, workers: dict[int, WorkerView], entries: dict[str, Entry]):
        self.workers = workers
        self.entries = entries
        self.where: dict[str, tuple[int, WorkerView]] = {}  # group -> the worker its first placed sample went to
        self.members: dict[str, set[str]] = {}  # group -> its samples placed and not yet forgotten

    def preferred(self, e: Entry) -> int | None:
        """The worker `e`'s group went to, while that worker (the same one, not a restart) serves."""
        at = self.where.get(e.group) if e.group is not None else None
        if at is None or self.workers.get(at[0]) is not at[1]:
            return None
        return at[0]

    def choose(self, e: Entry, candidates: Sequence[int], key: Callable[[int], Any]) -> int:
        """The worker for `e` among `candidates` (all would take it now): its group's, if there, else min by `key`."""
        wid = self.preferred(e)
        return wid if wid is not None and wid in candidates else min(candidates, key=key)

    def shared_tokens(self, e: Entry, wid: int, block_size: int) -> int:
        """Prompt tokens of `e` that worker `wid`'s prefix cache holds because a sibling runs there: the prompt's
        full blocks, short of the last token (vLLM computes at least that one)."""
        if e.group is None or not any(k != e.key and (o := self.entries.get(k)) is not None and o.worker_id == wid
                                      for k in self.members.get(e.group, ())):
            return 0
        return min(e.prompt_tokens, e.prompt_tokens + e.generated - 1) // block_size * block_size

    def cached_on(self, wid: int, block_size: int) -> Callable[[Entry], int]:
        """What a worker's step budget asks: how much of a request's prompt it holds (budget.py)."""
        return lambda e: self.shared_tokens(e, wid, block_size)

    def placed(self, e: Entry, wid: int) -> None:
        """`e` was admitted onto `wid`: what of its prompt is cached there, for what the worker owes; and the first
        of its group (or the first since its group's worker went) sets where the others go."""
        e.cached_prompt = self.shared_tokens(e, wid, self.workers[wid].spec.block_size)
        if e.group is None:
            return
        self.members.setdefault(e.group, set()).add(e.key)
        if self.preferred(e) is None:
            self.where[e.group] = (wid, self.workers[wid])

    def forgot(self, e: Entry) -> None:
        """`e` ended: its group's row goes with its last placed sample."""
        members = self.members.get(e.group) if e.group is not None else None
        if members is None:
            return
        members.discard(e.key)
        if not members:
            del self.members[e.group]
            self.where.pop(e.group, None)
