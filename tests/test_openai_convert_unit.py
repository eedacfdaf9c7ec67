"""The OpenAI door's traffic class: from tokenline's header, OpenAI's service_tier, or vLLM's priority (as clients
of `vllm serve` send it, tokenline's bench among them), the header first."""

from __future__ import annotations

import pytest

from tokenline.server.convert import InvalidRequest
from tokenline.server.openai_requests import CompletionRequest, to_generate_request
from tokenline.v1 import tokenline_pb2 as pb


@pytest.mark.parametrize("fields, headers, cls", [
    ({}, {}, pb.INTERACTIVE),
    ({"priority": 1}, {}, pb.BULK),
    ({"priority": 0}, {}, pb.INTERACTIVE),
    ({"priority": -5}, {}, pb.INTERACTIVE),
    ({"service_tier": "flex"}, {}, pb.BULK),
    ({"priority": 1}, {"x-tokenline-class": "interactive"}, pb.INTERACTIVE),
    ({}, {"x-tokenline-class": "bulk"}, pb.BULK),
])
def test_the_traffic_class_of_an_openai_request(fields, headers, cls):
    req = CompletionRequest.model_validate({"model": "m", "prompt": "hi", **fields})
    assert to_generate_request(req, headers).traffic_class == cls


def test_an_unknown_class_header_is_refused():
    with pytest.raises(InvalidRequest, match="interactive or bulk"):
        to_generate_request(CompletionRequest.model_validate({"prompt": "hi"}), {"x-tokenline-class": "gold"})
