"""The client's pure parts, without a server: requests, conversions, errors, retry config, timing, CLI output."""

from __future__ import annotations

import argparse
import json

import grpc
import pytest
from grpc import aio
from tokenline.client import (
    Delta,
    InvalidRequest,
    NotFound,
    Overloaded,
    ServerError,
    ServerTimeline,
    Unavailable,
    Usage,
    channel_options,
    error_from_rpc,
    errors,
    itl_gaps,
    service_config_json,
    stream_timing,
)
from tokenline.client._channel import auth_metadata, channel_credentials
from tokenline.client._convert import (
    build_request,
    call_deadline,
    completion_from_response,
    delta_from_chunk,
    timeline_from_proto,
)
from tokenline.client.cli import add_generate_parser, format_duration, result_json, summary_line
from tokenline.v1 import tokenline_pb2 as pb


def rpc_error(code, details="", trailing=()):
    """A real grpc.aio error, as a failed call raises it."""
    return aio.AioRpcError(code, aio.Metadata(), aio.Metadata(*trailing), details)


def delta(received_at, tokens, **final):
    return Delta(
        request_id="r", attempt=1, index=0, token_ids=tuple(tokens), text="x" * len(tokens),
        received_at=received_at, **final,
    )  # fmt: skip


# --- proto Timeline -> ServerTimeline -------------------------------------------------


def test_timeline_stamps_the_server_did_not_set_are_none():
    timeline = timeline_from_proto(
        pb.Timeline(received_ms=0, admitted_ms=1.5, ttft_ms=20, attempts=1)
    )

    assert timeline.first_token_ms is None
    assert timeline.finished_ms is None
    assert timeline.last_byte_ms is None
    assert timeline.first_scheduled_ms is None
    assert timeline.admitted_ms == 1.5
    assert timeline.ttft_ms == 20
    assert timeline.attempts == 1


def test_timeline_stamps_that_are_set_keep_their_value_even_zero():
    timeline = timeline_from_proto(
        pb.Timeline(first_token_ms=0.0, finished_ms=30.0, last_byte_ms=31.0, first_scheduled_ms=2.0)
    )

    assert timeline.first_token_ms == 0.0
    assert (timeline.finished_ms, timeline.last_byte_ms, timeline.first_scheduled_ms) == (
        30.0,
        31.0,
        2.0,
    )


def test_only_the_last_chunk_carries_finish_reason_usage_and_timeline():
    middle = delta_from_chunk(
        pb.GenerateChunk(request_id="r", attempt=1, index=3, token_ids=[7, 8], text="ab"), 5.0
    )
    last = delta_from_chunk(
        pb.GenerateChunk(
            request_id="r", attempt=2, index=5, finish_reason=pb.STOP_STRING,
            usage=pb.Usage(prompt_tokens=14, completion_tokens=5), timeline=pb.Timeline(ttft_ms=9),
        ),
        6.0,
    )  # fmt: skip

    assert middle == Delta("r", 1, 3, (7, 8), "ab", 5.0, None, None, None)
    assert last.finish_reason == "stop_string"
    assert last.usage == Usage(prompt_tokens=14, completion_tokens=5)
    assert isinstance(last.timeline, ServerTimeline) and last.timeline.ttft_ms == 9
    assert last.attempt == 2


def test_a_complete_response_becomes_a_completion():
    completion = completion_from_response(
        pb.CompleteResponse(
            request_id="c", attempt=1, token_ids=[1, 2], text="hi", finish_reason=pb.LENGTH
        )
    )

    assert (completion.text, completion.token_ids, completion.finish_reason) == (
        "hi",
        (1, 2),
        "length",
    )
    assert completion.usage is None and completion.timeline is None


# --- building requests ----------------------------------------------------------------


def test_a_text_prompt_sends_only_the_sampling_fields_given():
    request = build_request("Hello", max_tokens=8, temperature=0.0, seed=7)

    assert request.WhichOneof("prompt") == "text" and request.text == "Hello"
    assert request.sampling.max_tokens == 8
    assert request.sampling.HasField("temperature") and request.sampling.temperature == 0.0
    assert request.sampling.seed == 7
    assert not request.sampling.HasField("top_p")
    assert not request.sampling.HasField("top_k")
    assert request.traffic_class == pb.INTERACTIVE
    assert request.deadline_unix_ms == 0


def test_messages_may_be_dicts_or_role_content_pairs():
    request = build_request(messages=[{"role": "system", "content": "Be brief."}, ("user", "Hi")])

    assert request.WhichOneof("prompt") == "chat"
    assert [(m.role, m.content) for m in request.chat.messages] == [
        ("system", "Be brief."),
        ("user", "Hi"),
    ]


def test_token_ids_are_sent_as_given():
    request = build_request(token_ids=[1, 42, 7], traffic_class="bulk", request_id="job-1")

    assert list(request.token_ids.ids) == [1, 42, 7]
    assert request.traffic_class == pb.BULK
    assert request.request_id == "job-1"


def test_a_single_stop_string_is_one_stop_string_not_its_characters():
    assert list(build_request("x", stop="\n\n").sampling.stop) == ["\n\n"]
    assert list(build_request("x", stop=["a", "b"]).sampling.stop) == ["a", "b"]


@pytest.mark.parametrize(
    "prompts",
    [
        {},
        {"prompt": "a", "messages": [("user", "b")]},
        {"prompt": "a", "token_ids": [1]},
        {"messages": [("user", "b")], "token_ids": [1]},
    ],
)
def test_exactly_one_of_prompt_messages_or_token_ids_is_required(prompts):
    with pytest.raises(ValueError, match="exactly one"):
        build_request(**prompts)


@pytest.mark.parametrize(
    "arguments",
    [
        {"messages": []},
        {"messages": [{"role": "user"}]},
        {"messages": ["just text"]},
        {"token_ids": [1, -1]},
        {"token_ids": [1.5]},
        {"prompt": "x", "traffic_class": "batch"},
        {"prompt": "x", "max_tokens": 0},
    ],
)
def test_arguments_no_server_would_accept_raise_value_error(arguments):
    with pytest.raises(ValueError):
        build_request(**arguments)


def test_a_relative_deadline_sets_both_the_grpc_timeout_and_the_absolute_deadline():
    assert call_deadline(deadline_s=2.5, timeout=None, now_unix_s=1000.0) == (2.5, 1_002_500)


def test_a_timeout_alone_bounds_only_the_call():
    assert call_deadline(deadline_s=None, timeout=3.0, now_unix_s=1000.0) == (3.0, 0)


def test_the_earlier_of_deadline_and_timeout_bounds_the_call():
    assert call_deadline(deadline_s=5.0, timeout=1.0, now_unix_s=1000.0) == (1.0, 1_005_000)


@pytest.mark.parametrize("bad", [0, -1.0, float("inf"), float("nan")])
def test_a_deadline_must_be_a_positive_number_of_seconds(bad):
    with pytest.raises(ValueError, match="deadline_s"):
        call_deadline(deadline_s=bad, timeout=None, now_unix_s=0.0)


# --- errors -----------------------------------------------------------------------------


def test_resource_exhausted_with_a_pushback_trailer_is_overloaded_with_retry_after():
    error = error_from_rpc(
        rpc_error(
            grpc.StatusCode.RESOURCE_EXHAUSTED, "queue full", [("grpc-retry-pushback-ms", "750")]
        )
    )

    assert isinstance(error, Overloaded)
    assert error.retry_after_s == 0.75
    assert error.code == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert error.details == "queue full"
    assert str(error) == "queue full [RESOURCE_EXHAUSTED] (retry after 0.75 s)"


@pytest.mark.parametrize(
    "trailing", [(), [("grpc-retry-pushback-ms", "-1")], [("grpc-retry-pushback-ms", "soon")]]
)
def test_without_a_valid_pushback_there_is_no_retry_hint(trailing):
    assert (
        error_from_rpc(rpc_error(grpc.StatusCode.RESOURCE_EXHAUSTED, "", trailing)).retry_after_s
        is None
    )


def test_a_binary_pushback_value_is_read_too():
    assert errors.retry_after_from_metadata([("grpc-retry-pushback-ms", b"1200")]) == 1.2


@pytest.mark.parametrize(
    "code, error_class",
    [
        (grpc.StatusCode.INVALID_ARGUMENT, InvalidRequest),
        (grpc.StatusCode.NOT_FOUND, NotFound),
        (grpc.StatusCode.ALREADY_EXISTS, errors.AlreadyExists),
        (grpc.StatusCode.UNAUTHENTICATED, errors.Unauthenticated),
        (grpc.StatusCode.PERMISSION_DENIED, errors.PermissionDenied),
        (grpc.StatusCode.RESOURCE_EXHAUSTED, Overloaded),
        (grpc.StatusCode.DEADLINE_EXCEEDED, errors.DeadlineExceeded),
        (grpc.StatusCode.UNAVAILABLE, Unavailable),
        (grpc.StatusCode.CANCELLED, errors.Cancelled),
        (grpc.StatusCode.FAILED_PRECONDITION, errors.Refused),
        (grpc.StatusCode.INTERNAL, ServerError),
        (grpc.StatusCode.UNIMPLEMENTED, ServerError),
    ],
)
def test_each_status_maps_to_its_error_class(code, error_class):
    error = error_from_rpc(rpc_error(code, "why"))

    assert type(error) is error_class
    assert isinstance(error, errors.TokenlineError)
    assert (error.code, error.details) == (code, "why")


def test_an_rpc_error_without_a_status_is_an_unknown_server_error():
    error = error_from_rpc(grpc.RpcError())

    assert isinstance(error, ServerError) and error.code == grpc.StatusCode.UNKNOWN


def test_an_error_message_fits_on_one_line():
    error = error_from_rpc(
        rpc_error(grpc.StatusCode.UNAVAILABLE, "failed to connect\n  last error: refused")
    )

    assert str(error) == "failed to connect last error: refused [UNAVAILABLE]"


# --- channel setup ----------------------------------------------------------------------


def service_config():
    return json.loads(dict(channel_options())["grpc.service_config"])


def method_config(config, method):
    return next(
        c
        for c in config["methodConfig"]
        if {"service": "tokenline.v1.Tokenline", "method": method} in c["name"]
    )


def test_the_service_config_names_the_service_of_the_proto():
    names = {n["service"] for c in service_config()["methodConfig"] for n in c["name"]}

    assert (
        names
        == {pb.DESCRIPTOR.services_by_name["Tokenline"].full_name}
        == {"tokenline.v1.Tokenline"}
    )
    assert json.loads(service_config_json()) == service_config()


@pytest.mark.parametrize("method", ["Generate", "Complete", "Cancel", "ListModels"])
def test_every_method_retries_unavailable_with_exponential_backoff(method):
    assert method_config(service_config(), method)["retryPolicy"] == {
        "maxAttempts": 4,
        "initialBackoff": "0.1s",
        "maxBackoff": "2s",
        "backoffMultiplier": 2,
        "retryableStatusCodes": ["UNAVAILABLE"],
    }


def test_only_list_models_waits_for_the_server_to_be_ready():
    config = service_config()

    assert method_config(config, "ListModels")["waitForReady"] is True
    assert not method_config(config, "Generate").get("waitForReady", False)
    assert not method_config(config, "Complete").get("waitForReady", False)


def test_retries_are_enabled_and_throttled():
    assert dict(channel_options())["grpc.enable_retries"] == 1
    assert service_config()["retryThrottling"] == {"maxTokens": 10, "tokenRatio": 0.1}


def test_a_caller_option_replaces_ours_of_the_same_name():
    options = channel_options(
        [("grpc.enable_retries", 0), ("grpc.max_receive_message_length", 1 << 20)]
    )

    assert dict(options)["grpc.enable_retries"] == 0
    assert dict(options)["grpc.max_receive_message_length"] == 1 << 20
    assert len(options) == len(dict(options))


def test_the_api_key_travels_as_a_bearer_token():
    assert auth_metadata("k1") == (("authorization", "Bearer k1"),)
    assert auth_metadata(None) == ()


def test_tls_is_off_without_certificates_and_a_client_certificate_needs_both_halves():
    assert channel_credentials(False, None, None, None) is None
    assert channel_credentials(True, None, None, None) is not None
    with pytest.raises(ValueError, match="both"):
        channel_credentials(False, None, b"key", None)


# --- client-side timing -----------------------------------------------------------------


def test_a_multi_token_chunk_counts_as_one_gap_per_token():
    # 1 token at t=1.0, then 3 tokens at t=1.3 (0.3 s for three tokens), then 1 at t=1.4.
    deltas = [delta(1.0, [1]), delta(1.3, [2, 3, 4]), delta(1.4, [5])]

    assert itl_gaps(deltas) == pytest.approx([0.1, 0.1, 0.1, 0.1])


def test_tokens_sharing_the_first_chunk_arrived_together():
    assert itl_gaps([delta(1.0, [1, 2, 3]), delta(1.2, [4])]) == pytest.approx([0.0, 0.0, 0.2])


def test_stream_timing_measures_from_the_send_and_ignores_tokenless_chunks():
    deltas = [
        delta(0.5, []),
        delta(1.0, [1, 2]),
        delta(1.6, [3, 4, 5]),
        delta(1.7, [], finish_reason="stop"),
    ]

    timing = stream_timing(sent_at=0.2, deltas=deltas)

    assert timing.ttft_s == pytest.approx(0.8)  # first chunk that carries a token
    assert timing.itl_mean_s == pytest.approx(0.6 / 4)  # (1.6 - 1.0) over 4 gaps
    assert timing.total_s == pytest.approx(1.5)
    assert (timing.tokens, timing.chunks) == (5, 4)


def test_a_single_token_has_no_inter_token_latency():
    timing = stream_timing(sent_at=0.0, deltas=[delta(0.1, [1])])

    assert timing.itl_mean_s is None and timing.ttft_s == pytest.approx(0.1)


# --- the generate command ----------------------------------------------------------------


def parse(*argv):
    parser = argparse.ArgumentParser(prog="tokenline")
    add_generate_parser(parser.add_subparsers(dest="command"))
    return parser.parse_args(["generate", *argv])


def test_the_cli_defaults_to_a_greedy_chat_request():
    args = parse("What is the capital of France?")

    # max_tokens None: the server's default (the rest of the context, capped), as vLLM's is.
    assert (args.chat, args.temperature, args.max_tokens, args.traffic_class) == (
        True,
        0.0,
        None,
        "interactive",
    )


def test_raw_sends_plain_text_and_stop_repeats():
    args = parse("--raw", "--stop", "\n", "--stop", "END", "--class", "bulk", "x")

    assert args.chat is False
    assert args.stop == ["\n", "END"]
    assert args.traffic_class == "bulk"


@pytest.mark.parametrize(
    "seconds, text",
    [(0.212, "212 ms"), (0.0571, "57.1 ms"), (1.94, "1.94 s"), (0.00042, "0.42 ms")],
)
def test_durations_read_in_units_a_person_scans(seconds, text):
    assert format_duration(seconds) == text


def test_the_summary_puts_client_timing_first_then_the_servers():
    timeline = timeline_from_proto(
        pb.Timeline(ttft_ms=180, admission_wait_ms=2, queueing_ms=1, attempts=1)
    )
    deltas = [
        delta(0.212, [1]),
        delta(0.269, [2]),
        delta(1.94, [], finish_reason="stop", usage=Usage(14, 32), timeline=timeline),
    ]

    line = summary_line(deltas, stream_timing(0.0, deltas))

    assert (
        line
        == "ttft 212 ms · itl 57.0 ms (mean) · total 1.94 s · 32 tokens (prompt 14) · stop · server ttft 180 ms (queued 3.0 ms)"
    )


def test_the_json_result_holds_the_whole_text_and_the_timeline():
    deltas = [
        delta(0.1, [1, 2]),
        delta(0.2, [], finish_reason="length", timeline=timeline_from_proto(pb.Timeline())),
    ]

    result = result_json(deltas, stream_timing(0.0, deltas))

    assert result["text"] == "xx" and result["token_ids"] == [1, 2]
    assert result["finish_reason"] == "length"
    assert result["client"]["ttft_ms"] == 100.0
    assert result["timeline"]["first_token_ms"] is None
    json.dumps(result)


def test_generate_ends_an_answer_cut_at_max_tokens_before_the_summary_line(sim_server):
    import subprocess
    import sys

    cmd = [sys.executable, "-m", "tokenline.server.cli", "generate", "--target", sim_server.address,
           "--max-tokens", "5", "tell me about the heart of the city"]
    apart = subprocess.run(cmd, capture_output=True, text=True, timeout=60)
    together = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=60)

    assert apart.returncode == 0 and together.returncode == 0, apart.stderr
    assert apart.stdout.endswith("\n")  # the answer's line is ended, though the answer was cut short
    assert apart.stderr.startswith("ttft ")
    assert together.stdout.splitlines()[-1].startswith("ttft ")  # the summary on a line of its own
    assert "length" in together.stdout.splitlines()[-1]
