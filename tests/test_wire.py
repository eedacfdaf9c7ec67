"""What crosses the pipe between a worker and the frontend."""

from __future__ import annotations

import dataclasses
import pickle

from tokenline.engine.types import FinishReason, SeqOutput, StepReport


def test_a_step_report_s_outputs_cross_the_worker_pipe_with_every_field_as_sent():
    """SeqOutput pickles as its fields in order (a cheaper unpickle on the frontend's reader thread): every
    field, present and future, must come back as it was sent."""
    values = {"key": "k@2", "new_token_ids": [4, 5], "text": "ab", "finished": True, "finish_reason": FinishReason.STOP,
              "prompt_tokens": 7, "logprobs": [((4, -0.5, 1, "a"), ())], "prompt_logprobs": [((1, -1.0, 2, "p"), ())],
              "cached_tokens": 3}
    names = [f.name for f in dataclasses.fields(SeqOutput)]
    assert sorted(values) == sorted(names), "a new SeqOutput field: give it a value here"
    out = SeqOutput(**values)
    report = pickle.loads(pickle.dumps(StepReport(1, 2, 0.01, 1, 0, 9, 1, 0, outputs=[out]), pickle.HIGHEST_PROTOCOL))
    assert report.outputs == [out] and [getattr(report.outputs[0], n) for n in names] == [values[n] for n in names]
