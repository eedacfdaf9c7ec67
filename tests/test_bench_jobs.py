"""`bench jobs`, short: jobs through a frontend SIGKILL on two real frontends; nothing lost or completed twice."""

import argparse
import asyncio

import pytest

from tokenline.bench import jobs

pytestmark = pytest.mark.engine


def test_no_job_is_lost_or_completed_twice_when_a_frontend_is_killed():
    args = argparse.Namespace(jobs=12, max_tokens=48, model="tiny", frontends=2, store=None, lease_s=2.0, kill_after=0.0,
                              timeout_s=300.0, json=False)
    report = asyncio.run(jobs.bench(args))
    assert report.accepted == 12
    assert (report.lost, report.completed_twice, report.index_errors) == (0, 0, 0), jobs.describe(report)
    assert report.end_states == {"succeeded": 12}
    assert report.taken_over >= 1  # killed while it ran jobs: the other frontend finished them
