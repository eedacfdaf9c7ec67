"""The engine ceiling: the bench's workload through vLLM in-process, with no server in the way.

    python -m tokenline.bench.ceiling --model FOLDER --requests requests.json --out ceiling.json

Run only as its own process (`bench compare` starts it): it imports vLLM, which
nothing else in the bench does. The engine is built with the settings of
tokenline's worker (engine/vllm_backend.py): in-process engine core, its dtype, eager,
explicit KV cache, priority scheduling, and its attention-kernel policy (`--attention-kernel auto`:
vLLM's choice less a kernel known to answer wrongly, so the ceiling is the best *right* engine; `vllm`:
vLLM's own choice, whatever it answers). `requests.json` holds two lists of
{"prompt_ids", "max_tokens", "ignore_eos"}:

- "throughput": all handed to `LLM.generate` at once: the engine's own output tokens/s.
- "sequential": one at a time, stepping the engine and timing each step's new
  tokens: the engine's own time to first token and inter-token latency at concurrency 1.

`--threads N` runs the engine on N OpenMP threads (the box's cores in one engine);
`--shard I/N --ready-dir D` runs every N-th throughput request in one of N engines started side
by side, all starting together once each has written its name into D (the box's cores as N
engines); `bench compare` adds up their output.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

from tokenline.engine.config import MiB, WorkerConfig
from tokenline.engine.flagspec import add_flags
from tokenline.engine.machine import choose_dtype


def build_llm(args: argparse.Namespace):  # noqa: ANN201 - vllm's type, imported late
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # as tokenline's worker: the engine core in this process
    from tokenline.engine.worker import compile_env

    for name, value in compile_env().items():  # a compiled engine caches its kernels where tokenline's workers do
        os.environ.setdefault(name, value)
    import torch
    from vllm import LLM

    from tokenline.engine.vllm_build import COMPILATION_CONFIG, KernelChoice

    if hasattr(torch, "cpu") and hasattr(torch.cpu, "_init_amx"):
        torch.cpu._init_amx()
    args.kernel = KernelChoice(args.attention_kernel, compiled=args.compile)  # wraps vLLM's chooser before the engine asks it
    return LLM(
        model=args.model, dtype=choose_dtype(args.dtype)[0], enforce_eager=not args.compile, kv_cache_memory_bytes=args.kv_cache_mb * MiB,
        block_size=args.block_size, max_num_seqs=args.max_seqs, max_model_len=args.max_model_len,
        max_num_batched_tokens=args.prefill_budget, scheduling_policy="priority", disable_log_stats=True,
        **({"compilation_config": COMPILATION_CONFIG} if args.compile else {}),  # compiled as tokenline's worker
    )  # fmt: skip


def sampling(request: dict, *, delta: bool = False):  # noqa: ANN201
    from vllm import SamplingParams
    from vllm.sampling_params import RequestOutputKind

    kind = RequestOutputKind.DELTA if delta else RequestOutputKind.FINAL_ONLY
    return SamplingParams(max_tokens=request["max_tokens"], temperature=0.0, ignore_eos=request["ignore_eos"],
                          output_kind=kind)


def throughput(llm, requests: list[dict]) -> dict:  # noqa: ANN001
    prompts = [{"prompt_token_ids": r["prompt_ids"]} for r in requests]
    started_at = time.time()
    start = time.perf_counter()
    outputs = llm.generate(prompts, [sampling(r) for r in requests], use_tqdm=False)
    duration = time.perf_counter() - start
    out_tokens = sum(len(o.outputs[0].token_ids) for o in outputs)
    in_tokens = sum(len(r["prompt_ids"]) for r in requests)
    return {"completed": len(outputs), "duration": duration, "total_input_tokens": in_tokens,
            "total_output_tokens": out_tokens, "output_throughput": out_tokens / duration,
            "started_at": started_at, "ended_at": started_at + duration,
            "request_throughput": len(outputs) / duration, "total_token_throughput": (in_tokens + out_tokens) / duration}


def sequential(llm, requests: list[dict]) -> dict:  # noqa: ANN001
    from tokenline.bench.records import itl_gaps
    from tokenline.bench.stats import summarize

    engine = llm.llm_engine
    ttfts, gaps, tpots = [], [], []
    for i, r in enumerate(requests):
        start = time.perf_counter()
        engine.add_request(f"seq-{i}", {"prompt_token_ids": r["prompt_ids"]}, sampling(r, delta=True))
        times, counts = [], []
        while engine.has_unfinished_requests():
            for out in engine.step():
                n = len(out.outputs[0].token_ids) if out.outputs else 0
                if n:
                    times.append(time.perf_counter() - start)
                    counts.append(n)
        if times:
            ttfts.append(times[0])
            gaps.extend(itl_gaps(times, counts))
            if sum(counts) > 1:
                tpots.append((times[-1] - times[0]) / (sum(counts) - 1))
    result: dict = {"completed": len(ttfts)}
    for name, values in (("ttft", ttfts), ("itl", gaps), ("tpot", tpots)):
        s = summarize([v * 1000 for v in values])
        result.update({f"mean_{name}_ms": s["mean"], f"median_{name}_ms": s["p50"], f"p90_{name}_ms": s["p90"],
                       f"p99_{name}_ms": s["p99"], f"{name}_count": s["count"]})
    return result


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m tokenline.bench.ceiling", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", required=True, help="model folder")
    p.add_argument("--requests", required=True, type=Path, help='JSON with "throughput" and "sequential" request lists')
    p.add_argument("--out", required=True, type=Path, help="where to write the results JSON")
    # one tokenline worker's settings, declared by WorkerConfig (engine/flagspec.py), with a bare config's defaults
    add_flags(p, WorkerConfig, only=("kv_cache_bytes", "max_seqs", "max_model_len", "block_size", "prefill_token_budget",
                                     "dtype", "attention_kernel", "threads"))
    p.add_argument("--compile", action="store_true",
                   help="compile the model (as `vllm serve` and `tokenline serve` do by default)")
    p.add_argument("--warmup", type=int, default=4, help="short unrecorded requests first (default %(default)s)")
    p.add_argument("--shard", default=None, metavar="I/N", help="run every N-th throughput request, from the I-th; no sequential run")
    p.add_argument("--ready-dir", type=Path, default=None, help="with --shard: start once all N shards are ready here")
    args = p.parse_args(argv)
    os.environ["OMP_NUM_THREADS"] = str(args.threads)  # before torch is imported
    workload = json.loads(args.requests.read_text())
    if args.shard:
        index, count = (int(x) for x in args.shard.split("/"))
        workload = {"throughput": workload.get("throughput", [])[index::count]}
    started = time.perf_counter()
    llm = build_llm(args)
    startup = time.perf_counter() - started
    warm = [dict(r, max_tokens=4) for r in (workload.get("sequential") or workload.get("throughput") or [])[: args.warmup]]
    if warm:
        llm.generate([{"prompt_token_ids": r["prompt_ids"]} for r in warm], [sampling(r) for r in warm], use_tqdm=False)
    result = {"engine": "vllm in-process (offline)", "startup_s": startup, "threads": args.threads,
              "attention_kernel": args.kernel.describe(), "compiled": args.compile}
    if args.shard and args.ready_dir:
        _wait_for_shards(args.ready_dir, index, count)
    if workload.get("throughput"):
        result["throughput"] = throughput(llm, workload["throughput"])
        print(f"ceiling: throughput {result['throughput']['output_throughput']:.0f} output tok/s", file=sys.stderr)
    if workload.get("sequential"):
        result["sequential"] = sequential(llm, workload["sequential"])
        print(f"ceiling: concurrency 1 ttft p50 {result['sequential']['median_ttft_ms']:.1f} ms", file=sys.stderr)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    return 0


def _wait_for_shards(folder: Path, index: int, count: int, timeout_s: float = 900.0) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / str(index)).touch()
    deadline = time.monotonic() + timeout_s
    while len(list(folder.iterdir())) < count and time.monotonic() < deadline:
        time.sleep(0.05)


if __name__ == "__main__":
    sys.exit(main())
