"""`tokenline bench structured`: JSON-schema outputs through SIGKILLs and preemptions, each judged by jsonschema."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from tokenline.bench.structured import Outcome, summarise, validate


@pytest.mark.parametrize("text, finish, valid", [
    ('{"answer": "yes", "confidence": 0.5}', "stop", True),
    ('{"answer": "perhaps", "confidence": 0.5}', "stop", False),  # not in the enum
    ('{"answer": "yes"}', "stop", False),  # a required field missing
    ('{"answer": "yes", "confidence": 0.5', "length", False),  # cut off
    ('{"answer": "yes", "confidence": 0.5} trailing', "stop", False),
])
def test_an_output_counts_only_when_complete_and_valid_against_its_schema(text, finish, valid):
    outcome = Outcome("plain", "verdict", True, text=text, finish=finish)
    validate(outcome)
    assert outcome.valid is valid and (outcome.error == "") is valid
    summary = summarise([outcome])
    assert summary["valid"] == int(valid) and len(summary["failures"]) == 1 - int(valid)


@pytest.mark.engine
def test_every_output_validates_through_a_sigkill_and_a_preemption(tmp_path):
    # Sampled only: the random tiny model, greedy, can fill a JSON value with whitespace to max_tokens.
    out = subprocess.run([sys.executable, "-m", "tokenline.server.cli", "bench", "structured", "--model", "tiny",
                          "--compile", "off", "--workers", "1", "--requests", "30", "--killed", "6", "--preempted", "10",
                          "--concurrency", "6", "--max-tokens", "600", "--greedy-share", "0", "--out", str(tmp_path)],
                         capture_output=True, text=True, timeout=600)
    summary = json.loads((tmp_path / "structured.json").read_text())
    assert out.returncode == 0, (summary["failures"], out.stderr[-2000:])
    assert summary["valid"] == summary["requests"] == 30
    assert summary["phases"]["killed"]["continued_after_a_crash"] >= 3, summary["phases"]
    # Most of the preempted phase's outputs were stopped mid-output and continued (10 of 10 here on a quiet machine;
    # under a CPU hog 8: a run whose JSON value ends within the people's wait for ITL room, which the default ITL
    # target gives them, finishes before anyone needs its slot). Each one counted is valid above.
    assert summary["phases"]["preempted"]["preempted"] >= 5, summary["phases"]
