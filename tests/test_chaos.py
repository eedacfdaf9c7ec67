"""A short chaos soak (bench/chaos.py): mixed traffic and jobs lose nothing while workers are killed and
stopped and the stores go away.

The full soak is `python -m tokenline.bench.chaos --minutes 10`; this is under a minute of load.
"""

import pytest

from tokenline.bench import chaos

pytestmark = pytest.mark.engine


def test_under_worker_kills_stops_store_outages_cancels_and_bad_input_no_request_or_job_is_lost_and_nothing_leaks():
    args = chaos.parse_args(["--minutes", "0.75", "--concurrency", "4", "--fault-min-s", "4", "--fault-max-s", "10",
                             "--sample-s", "5", "--quiet"])
    report = chaos.main_report(args)
    print(f"\nchaos soak (45 s): {report['requests']} requests {report['by_kind']}, faults {report['faults']}, "
          f"answers {report['answers']}, server RSS {report['server_rss_mb']['early_median']:.0f} -> "
          f"{report['server_rss_mb']['late_median']:.0f} MB")
    assert report["faults"].get("store_outage"), "no store outage"  # the first fault is one
    assert set(report["faults"]) - {"store_outage"}, "no worker fault was injected"
    assert report["by_kind"].get("job"), "no job was sent"
    assert report["stuck_jobs"] == 0, report["examples"]
    assert report["unknown_or_internal"] == 0, report["examples"]
    assert report["lost"] == 0, report["examples"]
    assert report["index_errors"] == 0, report["examples"]
    assert report["truncated"] == 0, report["examples"]
    assert report["replay_mismatch"] == 0, report["examples"]
    assert report["leaked_after_drain"] == {}
    assert report["alive_after"]
