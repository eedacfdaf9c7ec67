"""What the job tests read off real servers: which jobs ended where, and whole token streams."""

from __future__ import annotations

import re

ENDED = re.compile(r"job (\w+) ended (\w+)")


def ended(*servers):
    """job id -> how many times a server completed it (a server logs "job <id> ended" only after its
    fenced end-state write succeeded)."""
    counts = {}
    for s in servers:
        for line in s.lines:
            m = ENDED.search(line)
            if m:
                counts[m.group(1)] = counts.get(m.group(1), 0) + 1
    return counts


def tokens_of(chunks):
    for a, b in zip(chunks, chunks[1:]):
        assert b.index == a.index + len(a.token_ids)  # no gap, no repeat
    return [t for c in chunks for t in c.token_ids]


def watch_to_end(client, job_id, from_index=0):
    chunks = list(client.watch_job(job_id, from_index, timeout=240))
    assert chunks[-1].state == "succeeded", chunks[-1]
    return chunks
