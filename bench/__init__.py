"""tokenline's bench: drive a server with a workload and report what its callers would see.

    cli.py, commands.py   `tokenline bench run | capacity | compare | simulate | loadgen`
    workload.py           traffic streams (class, arrivals, lengths, deadline, SLO) and the seeded plan
    arrivals.py           open-loop arrival processes: Poisson, gamma (burstiness), constant
    prompts.py            random-token prompts from the model's tokenizer, or a JSONL / ShareGPT file
    targets.py            tokenline over gRPC, or an OpenAI-compatible server over SSE
    runner.py             the load generator: one asyncio loop, sends on schedule, notices falling behind
    records.py            what is recorded per request, and the latencies derived from it
    report.py, stats.py   summaries per class and in total, goodput, the server's split, tables
    session.py            one run end to end, and its output files
    capacity.py           the capacity search (bracketing, bisection, early stop)
    plots.py              PNG plots
    compare.py, servers.py  tokenline vs `vllm serve` vs the engine, servers started here
    ceiling.py, vllm_serve.py  run as their own processes; the only bench modules that import vLLM
    loadgen.py, loopback.py    the load generator's own ceiling, against a stand-in server
    simulate.py           the capacity simulator (the real scheduler in virtual time)
"""
