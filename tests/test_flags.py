"""Flags are owned by their configs: each config field's flag is declared once, beside the field
(engine/flagspec.py), `tokenline serve` and the bench build their parsers from those declarations,
and a parsed command line reads back into the configs by field name, in the field's unit."""

from __future__ import annotations

import argparse
import dataclasses

import pytest

from tokenline.bench.cli import add_bench_parser
from tokenline.engine.autoscale import AutoscaleConfig
from tokenline.engine.config import MiB, WorkerConfig
from tokenline.engine.flagspec import add_flags, flag, flag_specs, read_flags
from tokenline.engine.scheduler.config import SchedulerConfig
from tokenline.server.app import ServeConfig
from tokenline.server.convert import Limits
from tokenline.server.flags import add_serve_parser
from tokenline.server.jobrunner import JobConfig
from tokenline.server.telemetry_config import TelemetryConfig
from tokenline.server.web import WebConfig

SERVE_CONFIGS = (WorkerConfig, SchedulerConfig, Limits, AutoscaleConfig, JobConfig, WebConfig, TelemetryConfig, ServeConfig)


def serve(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_serve_parser(parser.add_subparsers())
    return parser.parse_args(["serve", *argv])


def bench(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_bench_parser(parser.add_subparsers())
    return parser.parse_args(["bench", *argv])


def worker(args: argparse.Namespace, **fields) -> WorkerConfig:
    return read_flags(args, WorkerConfig, **{"model_path": "m", "model_name": "m", "kv_cache_bytes": 64 * MiB,
                                             "threads": 1, **fields})


@pytest.mark.parametrize("argv, config, field, value", [
    (["--max-seqs", "32"], WorkerConfig, "max_seqs", 32),
    (["--prefill-budget", "256"], WorkerConfig, "prefill_token_budget", 256),  # flag and field named apart
    (["--engine", "sim"], WorkerConfig, "backend", "sim"),
    (["--attention-kernel", "vec16"], WorkerConfig, "attention_kernel", "vec16"),
    (["--sim-fixed-batch"], WorkerConfig, "sim_fixed_batch", True),
    (["--fault-marker", "BOOM"], WorkerConfig, "fault_marker", "BOOM"),
    (["--bulk-floor", "0.25"], SchedulerConfig, "bulk_floor", 0.25),
    (["--max-tokens-limit", "100", "--default-max-tokens", "50"], Limits, "default_max_tokens", 50),
    (["--web-port", "0", "--web-max-connections", "8"], WebConfig, "max_connections", 8),
    (["--request-log-level", "OFF"], TelemetryConfig, "request_log_level", "OFF"),
    (["--job-attempts", "2"], JobConfig, "max_attempts", 2),
    (["--autoscale-max-workers", "3", "--warm-workers", "1"], AutoscaleConfig, "warm_standby", 1),
    (["--step-watchdog-s", "0"], ServeConfig, "step_watchdog_s", 0.0),
    (["--api-keys", "keys.json"], ServeConfig, "api_keys_file", "keys.json"),
])
def test_a_serve_flag_reads_back_into_its_field_by_name(argv, config, field, value):
    args = serve(*argv)
    needed = {WorkerConfig: {"model_path": "m", "model_name": "m", "kv_cache_bytes": 64 * MiB, "threads": 1},
              JobConfig: {"store": "jobs.sqlite3"}, ServeConfig: {"models": (("m", 1),)},
              AutoscaleConfig: {"min_workers": 1}}.get(config, {})  # decided at start by serve
    assert getattr(read_flags(args, config, **needed), field) == value


def test_units_convert_between_the_flag_and_the_field():
    args = serve("--kv-cache-mb", "256", "--compile", "off", "--interactive-window-ms", "5",
                 "--interactive-itl-target-ms", "91.2", "--interactive-ttft-target-ms", "0")
    w = worker(args, kv_cache_bytes=args.kv_cache_mb * MiB)
    assert w.kv_cache_bytes == 256 * MiB and w.compile is False
    sched = read_flags(args, SchedulerConfig)
    assert sched.interactive.admission_window_s == pytest.approx(0.005)  # ms on the command line, seconds inside
    assert sched.interactive.itl_target_s == pytest.approx(0.0912)
    assert sched.interactive.ttft_target_s is None  # 0: the target off
    assert worker(serve("--compile", "on")).compile is True
    assert WorkerConfig.__dataclass_fields__["kv_cache_bytes"].metadata["flag"].to_flag(512 * MiB) == 512


def test_a_class_flag_sets_its_class_and_a_shared_flag_sets_both():
    sched = read_flags(serve("--bulk-window-ms", "7", "--queue-requests", "9", "--max-attempts", "5",
                             "--bulk-goal-tok-s", "100"), SchedulerConfig)
    assert sched.bulk.admission_window_s == pytest.approx(0.007)
    assert sched.interactive.admission_window_s == SchedulerConfig().interactive.admission_window_s
    assert sched.interactive.max_queued_requests == sched.bulk.max_queued_requests == 9
    assert sched.interactive.max_attempts == sched.bulk.max_attempts == 5
    assert sched.bulk.throughput_goal_tok_s == 100 and sched.interactive.throughput_goal_tok_s is None


def test_serve_without_flags_builds_the_configs_own_defaults():
    """The defaults a user gets are the dataclasses' own, except where serve decides from the machine or its
    own choice (the compiler on), and those are declared in one place (server/flags.py WORKER_DEFAULTS)."""
    args = serve()
    targets = dataclasses.replace(SchedulerConfig().interactive, itl_target_steps=3.0, ttft_target_first_tokens=3.0)
    assert read_flags(args, SchedulerConfig) == dataclasses.replace(SchedulerConfig(), interactive=targets)
    assert read_flags(args, TelemetryConfig) == TelemetryConfig()
    assert read_flags(args, JobConfig, store="s") == JobConfig(store="s")
    assert read_flags(args, ServeConfig, models=(("m", 1),)) == ServeConfig(models=(("m", 1),))
    bare = WorkerConfig(model_path="m", model_name="m", kv_cache_bytes=64 * MiB)
    assert worker(args) == dataclasses.replace(bare, compile=True)  # serve compiles unless told not to
    assert args.kv_cache_mb is None and args.threads is None  # planned from the machine at start
    assert args.default_max_tokens is None and args.autoscale_max_workers == 0 and args.web_port is None


def test_serve_protects_interactive_streams_unless_told_not_to():
    """Out of the box, interactive streams have an ITL target of 3 single-sequence steps of their worker and a TTFT
    target of 3 idle first tokens of a typical interactive prompt, at least 500 ms (the start-up line says so); a
    target given in ms replaces the multiple; 0 turns each off."""
    from tokenline.server.cli import targets_text

    sched = read_flags(serve(), SchedulerConfig)
    default = sched.interactive
    assert (default.itl_target_steps, default.ttft_target_first_tokens, default.itl_target_s, default.ttft_target_s) \
        == (3.0, 3.0, None, None)
    assert targets_text(default) == ("interactive targets: ITL 3 × the single-sequence step, "
                                     "TTFT 3 × an idle first token (at least 500 ms)")
    assert default.itl_target_for(single_step_s=0.04) == pytest.approx(0.12)
    assert default.ttft_target_for(idle_first_token_s=0.3, floor_s=sched.ttft_target_floor_s) == pytest.approx(0.9)
    assert default.ttft_target_for(idle_first_token_s=0.01, floor_s=sched.ttft_target_floor_s) == pytest.approx(0.5)
    given = read_flags(serve("--interactive-itl-target-ms", "90", "--interactive-ttft-target-ms", "250"),
                       SchedulerConfig).interactive
    assert given.itl_target_for(single_step_s=0.04) == pytest.approx(0.09)
    assert given.ttft_target_for(idle_first_token_s=0.3, floor_s=0.5) == pytest.approx(0.25)
    off = read_flags(serve("--interactive-itl-target-steps", "0", "--interactive-ttft-target-first-tokens", "0"),
                     SchedulerConfig)
    assert (off.interactive.itl_target_steps, off.interactive.ttft_target_first_tokens) == (None, None)
    assert targets_text(off.interactive) == "interactive targets off"
    assert read_flags(serve(), SchedulerConfig).bulk.ttft_target_s is None  # bulk is never held to them


def test_every_declared_flag_is_on_serve():
    """A flag declared on a config field is a flag of `tokenline serve` (none declared and left unreachable)."""
    actions = {a.dest for a in _serve_actions()}
    for config in SERVE_CONFIGS:
        for name, spec in flag_specs(config).items():
            assert spec.dest() in actions, f"{config.__name__}.{name}: {spec.name} is not a serve flag"
    for section in ("interactive", "bulk"):
        for spec in flag_specs(type(getattr(SchedulerConfig(), section))).values():
            if spec.only is None or section in spec.only:
                assert spec.dest(section) in actions


def test_the_bench_starts_tokenline_with_serves_engine_defaults():
    args = serve()
    compare = bench("compare")
    for dest in ("kv_cache_mb", "max_seqs", "threads", "compile", "interactive_slots", "max_model_len", "block_size",
                 "prefill_budget"):
        assert getattr(compare, dest) == getattr(args, dest), dest
    assert bench("features").compile == bench("structured").compile == args.compile == "on"
    assert bench("mixed").max_seqs == 48  # its own workload's choice, declared beside it
    assert bench("chaos").compile == "off"  # a killed worker is back in seconds


def test_a_config_with_a_flag_in_a_unit_it_does_not_know_is_refused():
    with pytest.raises(ValueError, match="unit"):
        @dataclasses.dataclass
        class Bad:
            x: float = flag(1.0, "--x", "x", unit="hours")


def test_a_group_can_show_another_default_and_help():
    @dataclasses.dataclass(frozen=True)
    class Demo:
        size_bytes: int = flag(4 * MiB, "--size-mb", "how big", unit="MiB")
        wait_s: float | None = flag(None, "--wait-ms", "how long; 0: never", unit="ms", none_at_zero=True, type=float)

    parser = argparse.ArgumentParser()
    add_flags(parser, Demo, defaults={"size_bytes": 8 * MiB}, helps={"wait_s": "custom"})
    args = parser.parse_args([])
    assert (args.size_mb, args.wait_ms) == (8, 0)
    assert read_flags(args, Demo) == Demo(size_bytes=8 * MiB, wait_s=None)
    assert read_flags(parser.parse_args(["--wait-ms", "250"]), Demo).wait_s == pytest.approx(0.25)
    assert "custom" in parser.format_help()


def _serve_actions():
    parser = argparse.ArgumentParser()
    sub = parser.add_subparsers()
    add_serve_parser(sub)
    return sub.choices["serve"]._actions
