"""One traffic class's queue for one model: FIFO per tenant, weighted fair across tenants.

Fairness is start-time fair queueing by token cost: each tenant has a virtual
time that grows by cost / weight when one of its requests is admitted; the next
request comes from the backlogged tenant with the smallest virtual time. A
tenant that was idle joins at the smallest active virtual time, so idleness
earns no credit and one tenant's flood cannot take another's share.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Iterator

from tokenline.engine.scheduler.records import Entry


class ClassQueue:
    def __init__(self, weight_of: Callable[[str], float] = lambda tenant: 1.0) -> None:
        self._weight_of = weight_of
        self._by_tenant: dict[str, deque[Entry]] = {}
        self._vtime: dict[str, float] = {}
        self.requests = 0
        self.tokens = 0
        self.with_deadline = 0  # entries that carry a deadline (skips scans when 0)

    def __len__(self) -> int:
        return self.requests

    def push(self, entry: Entry, *, front: bool = False) -> None:
        q = self._by_tenant.get(entry.tenant)
        if q is None:
            q = self._by_tenant[entry.tenant] = deque()
            floor = min((self._vtime[t] for t in self._by_tenant if t != entry.tenant), default=0.0)
            self._vtime[entry.tenant] = max(self._vtime.get(entry.tenant, 0.0), floor)
        if front:
            q.appendleft(entry)
        else:
            q.append(entry)
        self.requests += 1
        self.tokens += entry.cost
        self.with_deadline += entry.deadline is not None

    def peek(self) -> Entry | None:
        if not self._by_tenant:
            return None
        tenant = min(self._by_tenant, key=lambda t: (self._vtime[t], self._by_tenant[t][0].arrival))
        return self._by_tenant[tenant][0]

    def pop_admitted(self, entry: Entry) -> None:
        """Remove `entry` (the current peek) and charge its tenant."""
        self._remove(entry)
        self._vtime[entry.tenant] = self._vtime.get(entry.tenant, 0.0) + entry.cost / self._weight_of(entry.tenant)

    def remove(self, entry: Entry) -> None:
        self._remove(entry)

    def _remove(self, entry: Entry) -> None:
        q = self._by_tenant[entry.tenant]
        q.remove(entry)
        if not q:
            del self._by_tenant[entry.tenant]
        self.requests -= 1
        self.tokens -= entry.cost
        self.with_deadline -= entry.deadline is not None

    def oldest(self) -> Entry | None:
        heads = [q[0] for q in self._by_tenant.values()]
        return min(heads, key=lambda e: e.arrival, default=None)

    def __iter__(self) -> Iterator[Entry]:
        """Entries in the order they would be admitted (a simulation, no charge)."""
        vt = {t: self._vtime[t] for t in self._by_tenant}
        pos = {t: 0 for t in self._by_tenant}
        while True:
            live = [t for t in pos if pos[t] < len(self._by_tenant[t])]
            if not live:
                return
            t = min(live, key=lambda t: (vt[t], self._by_tenant[t][pos[t]].arrival))
            e = self._by_tenant[t][pos[t]]
            pos[t] += 1
            vt[t] += e.cost / self._weight_of(t)
            yield e
