"""The request surface's pure parts: penalties over a continuation's whole output, stop strings kept
in the text across attempts, sampling stored and read back, the client's format arguments."""

from __future__ import annotations

import dataclasses
import json
import random

import pytest

from tokenline.client._convert import build_request
from tokenline.engine.detokenize import StopAcrossAttempts
from tokenline.engine.types import Sampling
from tokenline.server.request import fingerprint


@pytest.mark.parametrize("presence, frequency, repetition", [(0.7, 0.0, 1.0), (0.0, 0.4, 1.0), (0.5, 0.3, 1.4),
                                                             (-0.5, 0.2, 0.8)])
def test_a_continuations_penalties_equal_vllms_over_the_uninterrupted_output(presence, frequency, repetition):
    """vLLM's own apply_penalties over (prompt, delivered + new) is the uninterrupted request; the
    processor sees the continuation's (prompt + delivered, new) with the request's penalties neutral."""
    import torch
    from vllm.model_executor.layers.utils import apply_penalties
    from vllm.v1.sample.logits_processor import BatchUpdate

    from tokenline.engine.vllm_continuation import EARLIER_OUTPUT, EarlierOutputPenalties
    from vllm import SamplingParams

    rng = random.Random(3)
    vocab = 64
    prompt = [rng.randrange(vocab) for _ in range(12)]
    delivered = [rng.randrange(vocab) for _ in range(9)]
    new = [rng.randrange(vocab) for _ in range(5)]
    logits = torch.randn(2, vocab, generator=torch.Generator().manual_seed(1))

    def padded(rows):
        width = max(map(len, rows))
        return torch.tensor([r + [vocab] * (width - len(r)) for r in rows], dtype=torch.long)

    expected = apply_penalties(logits.clone(), padded([prompt, prompt]), padded([delivered + new, delivered + new]),
                               torch.tensor([presence, presence]), torch.tensor([frequency, frequency]),
                               torch.tensor([repetition, repetition]))[1]

    processor = EarlierOutputPenalties(None, torch.device("cpu"), False)
    params = SamplingParams(extra_args={EARLIER_OUTPUT: {"delivered": len(delivered), "presence": presence,
                                                         "frequency": frequency, "repetition": repetition}})
    output = list(new)
    processor.update_state(BatchUpdate(batch_size=2, removed=[], added=[(1, params, prompt + delivered, output)], moved=[]))
    got = processor.apply(logits.clone())
    assert torch.allclose(got[1], expected, atol=1e-6)
    assert torch.equal(got[0], logits[0])  # another request's row is left alone

    output.append(7)  # the engine's live output list: the next step counts the new token too
    processor.update_state(None)
    expected_next = apply_penalties(logits.clone(), padded([prompt, prompt]), padded([delivered + new + [7]] * 2),
                                    torch.tensor([presence] * 2), torch.tensor([frequency] * 2),
                                    torch.tensor([repetition] * 2))[1]
    assert torch.allclose(processor.apply(logits.clone())[1], expected_next, atol=1e-6)

    processor.update_state(BatchUpdate(batch_size=1, removed=[1], added=[], moved=[]))
    assert torch.equal(processor.apply(logits.clone()), logits)


def test_a_stop_string_kept_in_the_text_can_complete_across_an_interruption():
    # The caller was shown "...xxST"; the continuation's text begins "OP": the stop string ends here.
    stops = StopAcrossAttempts("", ("STOP",), include=True, tail="xxST")
    assert stops.feed("OPyy", finished=False) == ("OP", True)
    fresh = StopAcrossAttempts("", ("STOP",), include=True, tail="xx")
    assert fresh.feed("abST", finished=False) == ("abST", False)  # nothing is held back when it is kept
    assert fresh.feed("OPzz", finished=False) == ("OP", True)
    assert StopAcrossAttempts("ST", ("STOP",)).feed("OPq", finished=False) == ("", True)  # cut before it


def test_sampling_read_back_from_the_job_store_is_the_same_work():
    sampling = Sampling(max_tokens=9, stop=("a",), stop_token_ids=(3, 4), logit_bias=((5, -1.5), (9, 2.0)),
                        presence_penalty=0.5, logprobs=2, structured=("regex", "[ab]+"))
    again = Sampling.from_dict(json.loads(json.dumps(dataclasses.asdict(sampling))))
    assert again == sampling
    assert fingerprint("m", again, [1, 2]) == fingerprint("m", sampling, [1, 2])
    for change in (dict(presence_penalty=0.6), dict(logit_bias=((5, -1.5),)), dict(structured=("regex", "[ab]*")),
                   dict(min_tokens=1), dict(logprobs=None)):
        assert fingerprint("m", dataclasses.replace(sampling, **change), [1, 2]) != fingerprint("m", sampling, [1, 2])


def test_the_client_sends_one_format_and_leaves_max_tokens_to_the_server():
    request = build_request("hi", json_schema={"type": "object"}, logprobs=0, logit_bias={3: -100})
    assert json.loads(request.sampling.structured_output.json_schema) == {"type": "object"}
    assert request.sampling.HasField("logprobs") and request.sampling.logprobs == 0
    assert request.sampling.max_tokens == 0 and not request.sampling.HasField("prompt_logprobs")
    assert list(build_request("hi", choice=["a", "b"]).sampling.structured_output.choice.choices) == ["a", "b"]
    with pytest.raises(ValueError, match="at most one output format"):
        build_request("hi", regex="a", grammar="root ::= \"a\"")
    with pytest.raises(ValueError, match="list of strings"):
        build_request("hi", choice="ab")
