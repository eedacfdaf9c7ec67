"""What a bench run sends: traffic streams, each with its class, arrivals, lengths, deadline and SLO.

A stream is written on the command line as comma-separated key=value pairs:

    name=chat,class=interactive,rate=4,input=256,output=64,slo_ttft_ms=200,slo_itl_ms=50
    name=batch,class=bulk,concurrency=8,input=1024,output=512-1024,deadline_ms=60000

Lengths are `N`, `A-B` (uniform), `normal:MEAN:STD` or `lognormal:MEDIAN:SIGMA`.
`model=NAME` (or `NAME@VERSION`) sends a stream's requests to that model of a server that serves several
(default: the run's `--model`, else the server's default); the results are then also given per model.
A stream with `rate` is open loop (arrival poisson, gamma with `burstiness`, or
constant); one with `concurrency` is closed loop. Every request of the plan is
derived from (seed, stream, index) alone, so a plan is the same on every run.
"""

from __future__ import annotations

import json
import math
import random
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from tokenline.bench.arrivals import ArrivalProcess
from tokenline.bench.prompts import FilePrompts, SyntheticPrompts

CLASSES = ("interactive", "bulk")


@dataclass(frozen=True)
class LengthDist:
    """A distribution of token counts, always at least 1."""

    kind: str  # "fixed" | "uniform" | "normal" | "lognormal"
    a: float
    b: float = 0.0

    @staticmethod
    def parse(text: str | int) -> LengthDist:
        s = str(text).strip()
        try:
            if s.isdigit():
                return LengthDist("fixed", int(s))
            if ":" in s:
                kind, a, b = s.split(":")
                if kind in ("normal", "lognormal"):
                    return LengthDist(kind, float(a), float(b))
            elif "-" in s:
                lo, hi = (int(x) for x in s.split("-"))
                if 1 <= lo <= hi:
                    return LengthDist("uniform", lo, hi)
        except ValueError:
            pass
        raise ValueError(f"length {s!r} is not N, A-B, normal:MEAN:STD or lognormal:MEDIAN:SIGMA (e.g. 256, 128-512)")

    def sample(self, rng: random.Random) -> int:
        if self.kind == "fixed":
            return max(1, int(self.a))
        if self.kind == "uniform":
            return rng.randint(int(self.a), int(self.b))
        if self.kind == "normal":
            return max(1, round(rng.gauss(self.a, self.b)))
        return max(1, round(self.a * math.exp(rng.gauss(0.0, self.b))))

    @property
    def mean(self) -> float:
        if self.kind == "fixed":
            return self.a
        if self.kind == "uniform":
            return (self.a + self.b) / 2
        if self.kind == "normal":
            return self.a
        return self.a * math.exp(self.b * self.b / 2)

    def __str__(self) -> str:
        if self.kind == "fixed":
            return f"{int(self.a)}"
        if self.kind == "uniform":
            return f"{int(self.a)}-{int(self.b)}"
        return f"{self.kind}:{self.a:g}:{self.b:g}"


@dataclass(frozen=True)
class Slo:
    """Service-level objective of one request; None bounds nothing.

    `itl_ms` bounds the request's mean inter-token gap (its time per output token).
    """

    ttft_ms: float | None = None
    itl_ms: float | None = None
    e2e_ms: float | None = None

    def as_dict(self) -> dict[str, float]:
        return {k: v for k, v in (("ttft_ms", self.ttft_ms), ("itl_ms", self.itl_ms), ("e2e_ms", self.e2e_ms)) if v is not None}


@dataclass(frozen=True)
class StreamSpec:
    """One traffic stream."""

    name: str
    traffic_class: str = "interactive"
    arrival: ArrivalProcess | None = None  # open loop; None: closed loop at `concurrency`
    concurrency: int | None = None
    input_len: LengthDist = LengthDist("fixed", 256)
    output_len: LengthDist | None = None  # None: the prompt file's hint, else 128
    deadline_ms: float | None = None  # from the request's scheduled arrival
    require_completion: bool = False  # ask the server to refuse what cannot complete by the deadline
    slo: Slo = field(default_factory=Slo)
    cancel_fraction: float = 0.0  # share of requests the client abandons part-way
    ignore_eos: bool = True
    prompts: str | None = None  # a prompt file; None: random tokens
    # Request features, to measure what each costs: logprobs (alternatives per token), n samples per
    # request, a JSON schema file the output must follow.
    logprobs: int | None = None
    n: int = 1
    json_schema: str | None = None
    temperature: float = 0.0  # greedy unless set (n > 1 needs sampling: vLLM refuses greedy samples)
    model: str | None = None  # the model its requests name ("name" or "name@version"); None: the run's

    def __post_init__(self) -> None:
        if self.traffic_class not in CLASSES:
            raise ValueError(f"stream {self.name}: class {self.traffic_class!r} is not one of {', '.join(CLASSES)}")
        if (self.arrival is None) == (self.concurrency is None):
            raise ValueError(f"stream {self.name}: give either rate=R (open loop) or concurrency=N (closed loop)")
        if self.concurrency is not None and self.concurrency < 1:
            raise ValueError(f"stream {self.name}: concurrency must be at least 1")
        if not 0.0 <= self.cancel_fraction <= 1.0:
            raise ValueError(f"stream {self.name}: cancel must be a fraction in [0, 1]")
        if self.deadline_ms is not None and not self.deadline_ms > 0:
            raise ValueError(f"stream {self.name}: deadline_ms must be positive")
        if not 1 <= self.n <= 16:
            raise ValueError(f"stream {self.name}: n must be in [1, 16]")
        if self.logprobs is not None and not 0 <= self.logprobs <= 20:
            raise ValueError(f"stream {self.name}: logprobs must be in [0, 20]")

    @property
    def open_loop(self) -> bool:
        return self.arrival is not None

    def with_rate(self, rate: float) -> StreamSpec:
        assert self.arrival is not None
        return replace(self, arrival=self.arrival.scaled(rate))

    def describe(self) -> dict[str, Any]:
        return {
            "name": self.name, "class": self.traffic_class,
            "arrival": self.arrival.kind if self.arrival else "closed",
            "rate": self.arrival.rate if self.arrival else None,
            "burstiness": self.arrival.burstiness if self.arrival else None,
            "concurrency": self.concurrency, "input": str(self.input_len),
            "output": str(self.output_len) if self.output_len else None,
            "deadline_ms": self.deadline_ms, "require_completion": self.require_completion, "slo": self.slo.as_dict(),
            "cancel_fraction": self.cancel_fraction, "ignore_eos": self.ignore_eos, "prompts": self.prompts,
            "logprobs": self.logprobs, "n": self.n, "json_schema": self.json_schema, "temperature": self.temperature,
        }  # fmt: skip


_STREAM_KEYS = ("name", "class", "rate", "arrival", "burstiness", "concurrency", "input", "output", "deadline_ms",
                "require_completion", "slo_ttft_ms", "slo_itl_ms", "slo_e2e_ms", "cancel", "ignore_eos", "prompts",
                "logprobs", "n", "json_schema", "temperature", "model")


def parse_stream(text: str, *, default_name: str = "main") -> StreamSpec:
    """A StreamSpec from `key=value,key=value` (see the module docstring)."""
    fields: dict[str, str] = {}
    for part in filter(None, (p.strip() for p in text.split(","))):
        key, sep, value = part.partition("=")
        if not sep or key not in _STREAM_KEYS:
            raise ValueError(f"stream {text!r}: {part!r} is not key=value with a key among {', '.join(_STREAM_KEYS)}")
        fields[key] = value
    return stream_from_fields(fields, default_name=default_name)


def stream_from_fields(fields: dict[str, Any], *, default_name: str = "main") -> StreamSpec:
    """A StreamSpec from a dict of the keys `parse_stream` takes (a workload file's entries too)."""
    unknown = set(fields) - set(_STREAM_KEYS)
    if unknown:
        raise ValueError(f"unknown stream keys: {', '.join(sorted(unknown))} (known: {', '.join(_STREAM_KEYS)})")

    def number(key: str) -> float | None:
        value = fields.get(key)
        if value is None or value == "":
            return None
        try:
            return float(value)
        except ValueError:
            raise ValueError(f"{key}={value!r} is not a number") from None

    rate = number("rate")
    arrival = None
    if rate is not None:
        arrival = ArrivalProcess(rate=rate, kind=str(fields.get("arrival", "poisson")), burstiness=number("burstiness") or 1.0)
    concurrency = number("concurrency")
    output = fields.get("output")
    return StreamSpec(
        name=str(fields.get("name", default_name)),
        traffic_class=str(fields.get("class", "interactive")),
        arrival=arrival,
        concurrency=int(concurrency) if concurrency is not None else None,
        input_len=LengthDist.parse(fields.get("input", 256)),
        output_len=LengthDist.parse(output) if output not in (None, "") else None,
        deadline_ms=number("deadline_ms"),
        require_completion=str(fields.get("require_completion", "false")).lower() in ("1", "true", "yes"),
        slo=Slo(number("slo_ttft_ms"), number("slo_itl_ms"), number("slo_e2e_ms")),
        cancel_fraction=number("cancel") or 0.0,
        ignore_eos=str(fields.get("ignore_eos", "true")).lower() not in ("0", "false", "no"),
        prompts=fields.get("prompts") or None,
        logprobs=int(number("logprobs")) if number("logprobs") is not None else None,
        n=int(number("n") or 1),
        json_schema=fields.get("json_schema") or None,
        temperature=number("temperature") or 0.0,
        model=fields.get("model") or None,
    )


@dataclass(frozen=True)
class PlannedRequest:
    """One request of a plan; `at` is its scheduled arrival in seconds from the start (None: closed loop)."""

    request_id: str
    stream: str
    traffic_class: str
    at: float | None
    prompt_ids: tuple[int, ...]
    prompt_text: str | None
    max_tokens: int
    ignore_eos: bool
    deadline_s: float | None
    cancel_after: int | None  # abandon the stream after this many tokens (None: never)
    require_completion: bool = False
    logprobs: int | None = None
    n: int = 1
    json_schema: str | None = None  # the schema's JSON text
    temperature: float = 0.0
    # Not seeded: vllm serve (vLLM 0.32 on a CPU) crashes on a seeded request whose prompt is computed
    # over several steps (tokenline's worker does not: engine/vllm_schedule_hook.py rewindable_generators_on_cpu).
    seed: int | None = None
    model: str | None = None  # the stream's model (None: the target's)


class RequestFactory:
    """Builds request i of one stream, the same for a given seed on every run."""

    def __init__(self, stream: StreamSpec, index: int, seed: int, source: SyntheticPrompts | FilePrompts,
                 *, send_text: bool = False, tokenizer: Any = None):
        self.stream, self.index, self.seed, self.source = stream, index, seed, source
        self.send_text, self.tokenizer = send_text, tokenizer
        self.schema = None
        if stream.json_schema:
            try:
                self.schema = json.dumps(json.loads(Path(stream.json_schema).read_text()))
            except (OSError, ValueError) as e:
                raise ValueError(f"stream {stream.name}: json_schema={stream.json_schema}: {e}") from None

    def make(self, i: int, at: float | None) -> PlannedRequest:
        s = self.stream
        rng = random.Random(f"{self.seed}/{self.index}/{i}")
        prompt = self.source.prompt(rng, s.input_len.sample(rng))
        if s.output_len is not None:
            max_tokens = s.output_len.sample(rng)
        else:
            max_tokens = prompt.output_len_hint or 128
        text = None
        if self.send_text:
            text = prompt.text if prompt.text is not None else self.tokenizer.decode(list(prompt.token_ids))
        cancel_after = None
        if s.cancel_fraction and rng.random() < s.cancel_fraction and max_tokens > 1:
            cancel_after = rng.randint(1, max_tokens - 1)
        return PlannedRequest(
            request_id=f"{s.name}-{i}", stream=s.name, traffic_class=s.traffic_class, at=at,
            prompt_ids=prompt.token_ids, prompt_text=text, max_tokens=max_tokens, ignore_eos=s.ignore_eos,
            deadline_s=s.deadline_ms / 1000 if s.deadline_ms else None, cancel_after=cancel_after,
            require_completion=s.require_completion and bool(s.deadline_ms),
            logprobs=s.logprobs, n=s.n, json_schema=self.schema, temperature=s.temperature, model=s.model,
        )  # fmt: skip


def open_loop_plan(factories: list[RequestFactory], *, seed: int, duration_s: float | None,
                   num_requests: int | None) -> list[PlannedRequest]:
    """All open-loop requests in arrival order: those before `duration_s`, the first `num_requests` of them."""
    timed: list[tuple[float, int, int]] = []
    for f in factories:
        arrival = f.stream.arrival
        assert arrival is not None
        times = arrival.schedule(seed=seed * 1009 + f.index, duration_s=duration_s, count=num_requests)
        timed.extend((t, f.index, i) for i, t in enumerate(times))
    timed.sort()
    if num_requests is not None:
        timed = timed[:num_requests]
    by_index = {f.index: f for f in factories}
    return [by_index[s].make(i, t) for t, s, i in timed]
