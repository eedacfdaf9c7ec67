"""Defaults from the machine: workers, threads and KV cache per worker (engine/machine.py), as plain functions,
and a real server started with no sizing flags."""

import pytest

from tokenline.engine.machine import (
    GiB, MiB, Machine, choose_dtype, cpu_flags, cpu_list_text, kv_bytes_per_token, node_available_memory, plan_workers,
    read_machine,
)


def test_one_single_thread_worker_per_usable_cpu():
    plan = plan_workers(Machine(cpus=2, available_bytes=22 * GiB))
    assert (plan.workers, plan.threads) == (2, 1)


def test_kv_cache_is_a_share_of_what_is_left_split_between_workers():
    machine = Machine(cpus=2, available_bytes=22 * GiB)
    one, two = plan_workers(machine, workers=1), plan_workers(machine, workers=2)
    assert two.kv_cache_bytes < one.kv_cache_bytes
    # frontend + every worker's own footprint + all the KV stay well inside what is available
    assert 1 * GiB + 2 * (2 * GiB + two.kv_cache_bytes) < machine.available_bytes
    assert 0 < two.kv_share < 1


def test_kv_cache_never_exceeds_what_max_seqs_sequences_of_max_model_len_can_use():
    plan = plan_workers(Machine(cpus=2, available_bytes=200 * GiB), kv_bytes_per_token=1024, max_seqs=4, max_model_len=1024)
    assert plan.kv_cache_bytes == 64 * MiB  # the cap (4 MiB) is below the floor
    plan = plan_workers(Machine(cpus=2, available_bytes=200 * GiB), kv_bytes_per_token=23040, max_seqs=64, max_model_len=4096)
    assert plan.kv_cache_bytes <= 23040 * 64 * 4096


def test_flags_override_the_machine():
    plan = plan_workers(Machine(cpus=8, available_bytes=64 * GiB), workers=3, threads=2, kv_cache_bytes=512 * MiB)
    assert (plan.workers, plan.threads, plan.kv_cache_bytes) == (3, 2, 512 * MiB)


def test_workers_given_without_threads_run_one_thread_each():
    assert plan_workers(Machine(cpus=8, available_bytes=64 * GiB), workers=2).threads == 1


def test_small_memory_limits_the_number_of_workers():
    plan = plan_workers(Machine(cpus=16, available_bytes=6 * GiB))
    assert plan.workers == 2


def test_one_worker_per_gpu():
    plan = plan_workers(Machine(cpus=16, available_bytes=64 * GiB, gpus=4))
    assert (plan.workers, plan.threads) == (4, 1)


def test_a_bad_flag_is_refused_with_its_name():
    with pytest.raises(ValueError, match="workers"):
        plan_workers(Machine(cpus=2, available_bytes=8 * GiB), workers=0)


def test_the_start_up_line_says_workers_threads_and_kv():
    line = plan_workers(Machine(cpus=2, available_bytes=22 * GiB)).describe()
    assert line.startswith("2 workers × 1 thread, KV ") and "% of available memory" in line


def test_workers_asked_to_be_pinned_that_fill_the_cpus_exactly_get_cpus_of_their_own_and_the_line_says_which():
    plan = plan_workers(Machine(cpus=2, available_bytes=22 * GiB, cpu_ids=(0, 1)), pin=True)
    assert plan.cpu_sets == ((0,), (1,))
    assert plan.describe().startswith("2 workers × 1 thread (pinned to CPUs 0 | 1), KV ")
    plan = plan_workers(Machine(cpus=4, available_bytes=64 * GiB, cpu_ids=(2, 3, 6, 7)), workers=2, threads=2, pin=True)
    assert plan.cpu_sets == ((2, 3), (6, 7))
    assert "(pinned to CPUs 2-3 | 6-7)" in plan.describe()


@pytest.mark.parametrize("machine, flags, why", [
    (Machine(cpus=4, available_bytes=64 * GiB, cpu_ids=(0, 1, 2, 3)), {"workers": 3}, "a CPU left over for the OS to balance"),
    (Machine(cpus=2, available_bytes=64 * GiB, cpu_ids=(0, 1)), {"workers": 4}, "workers that would share CPUs"),
    (Machine(cpus=2, available_bytes=64 * GiB, cpu_ids=(0, 1, 2, 3)), {}, "a cgroup quota: time, not particular CPUs"),
    (Machine(cpus=16, available_bytes=64 * GiB, gpus=16, cpu_ids=tuple(range(16))), {}, "a GPU does the work"),
    (Machine(cpus=2, available_bytes=22 * GiB), {}, "CPUs not known"),
    (Machine(cpus=2, available_bytes=22 * GiB, cpu_ids=(0, 1)), {"pin": False}, "not asked for: the default"),
])
def test_no_pinning_where_it_would_not_give_each_worker_cpus_of_its_own(machine, flags, why):
    plan = plan_workers(machine, **({"pin": True} | flags))
    assert plan.cpu_sets == (), why
    assert "pinned" not in plan.describe()


def test_cpu_lists_are_written_as_the_kernel_writes_them():
    assert cpu_list_text([8, 0, 1, 2, 3, 10, 11]) == "0-3,8,10-11"
    assert cpu_list_text([5]) == "5"


def test_this_machine_reads_sensibly():
    m = read_machine()
    assert m.cpus >= 1 and m.available_bytes > 0 and m.gpus >= 0


def test_kv_bytes_per_token_from_a_llama_config(tmp_path):
    (tmp_path / "config.json").write_text('{"num_hidden_layers": 30, "num_attention_heads": 9, "num_key_value_heads": 3, "hidden_size": 576}')
    assert kv_bytes_per_token(tmp_path) == 2 * 30 * 3 * 64 * 2
    assert kv_bytes_per_token(tmp_path / "missing") is None


@pytest.mark.parametrize("flags, dtype", [
    ({"avx", "avx2", "fma"}, "float32"),  # AVX2 alone: vLLM's bf16 matmuls take torch's slow path
    ({"avx2", "avx512f", "avx512bw"}, "bfloat16"),  # AVX-512: oneDNN runs bf16
    ({"avx2", "avx512f", "avx512_bf16"}, "bfloat16"),
    ({"avx2", "avx512f", "avx512_bf16", "amx_bf16", "amx_tile"}, "bfloat16"),
])
def test_auto_dtype_is_bf16_only_where_the_cpu_computes_it_fast(flags, dtype):
    chosen, why = choose_dtype("auto", frozenset(flags))
    assert chosen == dtype and why


def test_a_dtype_asked_for_is_kept_and_a_gpu_runs_bf16():
    assert choose_dtype("float16", frozenset({"avx2"}))[0] == "float16"
    assert choose_dtype("bfloat16", frozenset({"avx2"}))[0] == "bfloat16"
    assert choose_dtype("auto", frozenset({"avx2"}), gpus=1)[0] == "bfloat16"


def test_this_machines_flags_are_read():
    assert "sse2" in cpu_flags()  # every x86-64 CPU has it


def _node(root, n: int, cpus: str, free_kb: int, file_kb: int = 0) -> None:
    d = root / f"node{n}"
    d.mkdir(parents=True)
    (d / "cpulist").write_text(cpus + "\n")
    (d / "meminfo").write_text(f"Node {n} MemTotal:  {8 << 20} kB\nNode {n} MemFree:  {free_kb} kB\n"
                               f"Node {n} Active(file):  {file_kb} kB\nNode {n} Inactive(file):  0 kB\n"
                               f"Node {n} SReclaimable:  0 kB\n")


def test_memory_is_what_the_nodes_of_our_cpus_have_not_the_whole_machine(tmp_path):
    # vLLM's CPU worker checks its KV cache against its NUMA node's memory: a plan from the whole
    # machine's (a VM showed 23.5 GiB there and 8 GiB on its one node) asked more and failed to start.
    _node(tmp_path, 0, "0-1", free_kb=6 << 20, file_kb=1 << 20)
    _node(tmp_path, 1, "2-3", free_kb=30 << 20)
    assert node_available_memory(tmp_path, cpus={0, 1}) == 7 * GiB
    assert node_available_memory(tmp_path, cpus={1, 2}) == 37 * GiB
    assert node_available_memory(tmp_path / "absent", cpus={0}) > 1 << 50  # no nodes shown: no limit from them
    assert read_machine().available_bytes <= node_available_memory()


@pytest.mark.engine
def test_with_no_sizing_flags_the_server_sizes_itself_from_this_machine_and_starts_what_it_printed():
    import re

    from tests.support import ServerProcess, wait_until

    expected = plan_workers(read_machine())
    server = ServerProcess("--model", "tiny", "--compile", "off", machine_sized=True).start()
    try:
        line = next(line for line in server.lines if line.startswith("tokenline: tiny-llama: "))
        workers = "1 worker" if expected.workers == 1 else f"{expected.workers} workers"
        threads = "1 thread" if expected.threads == 1 else f"{expected.threads} threads"
        shape = re.match(rf"tokenline: tiny-llama: {workers} × {threads}(?: \(pinned to CPUs ([^)]*)\))?, KV ", line)
        assert shape, line
        def ready():  # the server serves once one worker is up; the others follow
            return set(re.findall(r"worker (\d+) ready: model tiny-llama, pid (\d+)", server.output()))

        assert wait_until(lambda: len(ready()) == expected.workers, timeout=180), server.output()[-3000:]
        if shape.group(1):  # pinned: each worker runs on the CPUs the line gave it
            sets = set(shape.group(1).split(" | "))
            for _, pid in ready():
                allowed = next(ln.split(":")[1].strip() for ln in open(f"/proc/{pid}/status")
                               if ln.startswith("Cpus_allowed_list"))
                assert allowed in sets, (allowed, sets)
    finally:
        server.stop()
