"""scripts/bench_server.py: a real server, one measured run, the CPU seconds of each of its processes and the time
they waited for a CPU, and the classification of a worker's perf samples."""
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "scripts"))
from bench_server import report_kinds, server_pids, wait_seconds  # noqa: E402  (scripts/ is not a package)

# Lines as `perf report --no-children --stdio --sort dso,sym -g none -t '|'` prints them for a float32 worker.
REPORT = """# Overhead|Shared Object|Symbol
 70.23% |lightserve_cpu_08f4657784b83db1.so               |[.] tile
 12.22% |lightserve_cpu_08f4657784b83db1.so               |[.] task_0_64_3
 4.27%  |lightserve_cpu_08f4657784b83db1.so               |[.] run_task
 3.49%  |libgomp.so.1                                     |[.] 0x000000000001de62
 2.97%  |libgomp.so.1                                     |[.] 0x000000000001e02a
 1.07%  |lightserve_cpu_08f4657784b83db1.so               |[.] silu_and_mul._omp_fn.0
 1.00%  |lightserve_cpu_08f4657784b83db1.so               |[.] linear_bf16_pairs._omp_fn.0
 0.50%  |[unknown]                                        |[.] 0x00007f0000001000
 0.36%  |libpython3.11.so.1.0                             |[.] _PyEval_EvalFrameDefault
 0.16%  |libtorch_cpu.so                                  |[.] c10::function_ref<void (char**)>::callback_fn
 0.37%  |libc.so.6                                        |[.] __memmove_avx512_unaligned_erms
"""


def test_perf_samples_are_grouped_by_kind_of_work():
    kinds = report_kinds(REPORT)
    assert kinds == {"GEMM (linear.c)": 71.23, "decode attention": 12.22, "OpenMP runtime (waiting)": 6.46,
                     "prefill attention": 4.27, "other C kernels": 1.07, "GEMM (oneDNN)": 0.5, "other": 0.37,
                     "Python and ctypes": 0.36, "torch ops and dispatch": 0.16}
    assert list(kinds)[0] == "GEMM (linear.c)"  # largest first


def test_server_pids_come_from_the_launcher_log():
    log = ("12:00:00.000 INFO [launcher] lightserve.engine.procs: started worker-tp0 pid 101\n"
           "12:00:00.001 INFO [launcher] lightserve.engine.procs: started worker-tp1 pid 102\n"
           "12:00:00.002 INFO [launcher] lightserve.engine.procs: started detokenizer pid 103\n"
           "12:00:01.000 INFO [launcher] lightserve.engine.procs: started router pid 104\n")
    assert server_pids(log, 100) == {"http": 100, "worker-tp0": 101, "worker-tp1": 102, "detokenizer": 103,
                                     "router": 104}


def test_wait_seconds_counts_the_time_a_process_waited_for_a_cpu():
    """Four processes released together, each computing for 0.3 s of CPU time on the one CPU all may use, wait
    about 0.9 s each for it (while the other three run): three times what each ran, so the reading is the wait,
    not the run time. A process that is gone reads 0."""
    spin = ("import time\nprint('ready', flush=True)\ninput()\nt0 = time.process_time()\n"
            "while time.process_time() - t0 < 0.3: pass\nprint('spun', flush=True)\ninput()")
    cpu = sorted(os.sched_getaffinity(0))[0]
    procs = [subprocess.Popen([sys.executable, "-c", spin], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                              preexec_fn=lambda: os.sched_setaffinity(0, {cpu})) for _ in range(4)]
    try:
        for p in procs:
            assert p.stdout.readline() == "ready\n"
        for p in procs:  # released within a millisecond of each other, so all four compete for the whole time
            p.stdin.write("\n")
            p.stdin.flush()
        for p in procs:
            assert p.stdout.readline() == "spun\n"
        waits = [wait_seconds(p.pid) for p in procs]  # all now wait on input(), off the CPU
    finally:
        for p in procs:
            p.communicate("\n", timeout=30)
    assert all(0.6 < w < 5.0 for w in waits), waits  # about 1.0 measured: startup on the one CPU adds to it
    assert wait_seconds(procs[0].pid) == 0.0  # reaped: gone


def test_a_measured_run_reports_each_process_cpu_time(tmp_path):
    """A real server on the real model: the worker, which runs the forward, spends the most CPU time in the run,
    and every process the launcher started is accounted for. Where `perf` works, the worker's samples are
    grouped too, and GEMMs are among them."""
    perf = shutil.which("perf") is not None and subprocess.run(
        ["perf", "record", "-q", "-o", str(tmp_path / "probe.data"), "true"], capture_output=True).returncode == 0
    out = subprocess.run(
        [sys.executable, str(REPO / "scripts" / "bench_server.py"), "--server", "--data_type float32",
         "--warmup-runs", "0", "--runs", "1", *(["--perf"] if perf else []), "--",
         "--dataset", "random", "--num-prompts", "16", "--input-len", "128", "--output-len", "16",
         "--max-concurrency", "16"],
        capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    row = json.loads(out.stdout.strip().splitlines()[-1])
    assert row["completed"] == 16
    cpu = row["cpu_s"]
    assert set(cpu) == {"http", "worker-tp0", "detokenizer", "router", "benchmark client"}, cpu
    assert cpu["worker-tp0"] > 0 and cpu["worker-tp0"] == max(cpu.values()), cpu
    wait = row["cpu_wait_s"]  # the server's processes only: the client's threads are gone when the run ends
    assert set(wait) == set(cpu) - {"benchmark client"} and all(w >= 0 for w in wait.values()), wait
    if perf:
        assert row["worker_perf_pct"].get("GEMM (linear.c)", 0) > 5, row["worker_perf_pct"]
