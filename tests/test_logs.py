"""The server log cannot be forged: whatever a caller puts in a field, one log record is one line."""

import grpc
import pytest

from tokenline.server.logs import escape
from tokenline.v1 import tokenline_pb2 as pb
from tokenline.v1 import tokenline_pb2_grpc as pb_grpc
from tests.support import ServerProcess, wait_until

FORGED = "FORGED 2026-12-01 00:00:00,000 INFO tokenline.server: all is well"


@pytest.fixture(scope="module")
def server():
    s = ServerProcess("--engine", "sim", "--model", "tiny", "--idempotency-db", "off").start()
    yield s
    s.stop()


@pytest.mark.parametrize("field, separator", [
    ("request_id", "\n"), ("request_id", "\r"), ("request_id", "\u2028"),
    ("model", "\n"), ("idempotency_key", "\n"), ("text", "\n"),
])
def test_a_caller_cannot_write_a_line_into_the_server_log(server, field, separator):
    marker = f"marker-{field}-{ord(separator)}"
    request = pb.GenerateRequest(text="hi", sampling=pb.SamplingParams(max_tokens=2))
    setattr(request, field, f"{marker}{separator}{FORGED}")
    with grpc.insecure_channel(server.address) as channel:
        try:
            pb_grpc.TokenlineStub(channel).Complete(request, timeout=30)
        except grpc.RpcError as err:
            assert err.code() in (grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.NOT_FOUND)

    if field == "request_id":  # the refusal is logged with the caller's value, escaped onto its own line
        assert wait_until(lambda: any(marker in line for line in server.lines), timeout=10), server.output()[-3000:]
    else:  # never logged as sent: an unknown model is "unknown", keys and prompts stay out of the log
        assert wait_until(lambda: any("id=" in line and "outcome=" in line for line in list(server.lines)[-50:]), timeout=10)
        assert not [line for line in server.lines if marker in line]
    lines = list(server.lines)
    # The output is read with universal newlines, so a raw "\r" (like "\n") would start a line of its own here.
    assert not [line for line in lines if line.startswith("FORGED")]
    assert not [line for line in lines if "\u2028" in line]


def test_escaping_puts_control_characters_on_one_line_and_leaves_text_alone():
    assert escape("a\nb\x00\u2028") == "a\\nb\\x00\\u2028"
    assert escape("plain text, quotes \" and spaces") == "plain text, quotes \" and spaces"
