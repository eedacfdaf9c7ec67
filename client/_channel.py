"""How the client's channel is set up: retry policy, channel options, TLS and the API key.

Retries are declared in gRPC's service config, never hand-rolled: gRPC retries
a call that fails with UNAVAILABLE (server down, restarting or draining) with
jittered exponential backoff, and retry throttling stops retrying when most calls
fail, so a struggling server is not hit harder. Two limits of gRPC retries:

- A streaming call (Generate) is retried only until the first response message
  arrives. Once tokens have been streamed, a failure reaches the caller, who
  decides whether to start again.
- RESOURCE_EXHAUSTED is not retried: the server refused on purpose and says when
  to come back (`Overloaded.retry_after_s`).

Generate, Complete and Cancel fail fast when the server is unreachable, so a
caller learns at once that it is down (with several frontends behind one target and
`round_robin`, a retry goes to the next one); ListModels waits for the channel to
become ready (bounded by its timeout), which suits start-up probes.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

import grpc

SERVICE = "tokenline.v1.Tokenline"
DEFAULT_TARGET = "127.0.0.1:50051"

RETRY_POLICY = {
    "maxAttempts": 4,
    "initialBackoff": "0.1s",
    "maxBackoff": "2s",
    "backoffMultiplier": 2,
    "retryableStatusCodes": ["UNAVAILABLE"],
}

SERVICE_CONFIG: dict[str, Any] = {
    "methodConfig": [
        {
            "name": [{"service": SERVICE, "method": m} for m in ("Generate", "Complete", "Cancel")],
            "retryPolicy": RETRY_POLICY,
            "waitForReady": False,
        },
        {
            "name": [{"service": SERVICE, "method": "ListModels"}],
            "retryPolicy": RETRY_POLICY,
            "waitForReady": True,
        },
    ],
    # Retry only while tokens > maxTokens / 2: each failure costs 1, each success earns 0.1.
    "retryThrottling": {"maxTokens": 10, "tokenRatio": 0.1},
}


def service_config_json(load_balancing: str | None = None) -> str:
    """The service config as the JSON the `grpc.service_config` channel option takes.

    `load_balancing` names a gRPC load-balancing policy ("round_robin": every address the
    target resolves to, e.g. several frontends behind one DNS name, gets calls in turn;
    default "pick_first": one address until it fails).
    """
    config = dict(SERVICE_CONFIG)
    if load_balancing:
        config["loadBalancingConfig"] = [{load_balancing: {}}]
    return json.dumps(config)


def channel_options(extra: Sequence[tuple[str, Any]] = (), load_balancing: str | None = None) -> list[tuple[str, Any]]:
    """Channel options with retries enabled (and the load-balancing policy, if named); an option
    in `extra` replaces ours of the same name."""
    options = {"grpc.enable_retries": 1, "grpc.service_config": service_config_json(load_balancing)}
    options.update(dict(extra))
    return list(options.items())


def auth_metadata(api_key: str | None) -> tuple[tuple[str, str], ...]:
    """Call metadata carrying the API key as a bearer token (none without a key)."""
    return (("authorization", f"Bearer {api_key}"),) if api_key else ()


def channel_credentials(
    tls: bool,
    root_certificates: bytes | None,
    private_key: bytes | None,
    certificate_chain: bytes | None,
) -> grpc.ChannelCredentials | None:
    """TLS credentials, or None for a plaintext channel.

    Any certificate turns TLS on; `tls=True` alone uses the system's root certificates.
    A client certificate (mutual TLS) needs both the key and the chain.
    """
    if (private_key is None) != (certificate_chain is None):
        raise ValueError("a client certificate needs both private_key and certificate_chain")
    if not (tls or root_certificates or private_key):
        return None
    return grpc.ssl_channel_credentials(
        root_certificates=root_certificates,
        private_key=private_key,
        certificate_chain=certificate_chain,
    )
