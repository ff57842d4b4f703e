"""Replicas on one machine: `dlmrt serve --replicas 1` against `--replicas 2` (one torch thread each), and
the single-process server with one thread beside them, under scripts/load_test.py, in interleaved runs.

    python scripts/replica_scaling.py --runs 3 --requests 1000 --concurrency 64 --json scaling.json

Each run starts each server afresh on a free loopback port (tiny model, its defaults), waits until it
serves, runs the load test against it, stops it with SIGTERM and checks that it exits with status 0;
the order of the servers turns with every run. The load generator runs on the same machine, so it
shares the cores with the servers. Printed: the medians of the runs, with their range, and the ratio
of the two replica counts' throughput (the median of the runs' ratios, with their range), as the
Markdown table docs/serving.md holds. The exit status is 1 when any request was lost or any server
did not exit cleanly.
"""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import click
import httpx

SERVERS = {  # name: (options of `dlmrt serve`, extra environment)
    "1 replica": (["--replicas", "1", "--threads-per-replica", "1"], {}),
    "2 replicas": (["--replicas", "2", "--threads-per-replica", "1"], {}),
    "one process, no Ray": ([], {"OMP_NUM_THREADS": "1"}),  # torch takes its thread count from it
}
LOAD_TEST = Path(__file__).with_name("load_test.py")


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def serve(options: list[str], environment: dict, port: int):
    """`dlmrt serve` on `port`, in a session of its own (Ray's processes with it): (the process, its output)."""
    server = subprocess.Popen([sys.executable, "-m", "dlmrt.cli", "serve", "--port", str(port), "--log-level",
                               "warning", *options], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                              start_new_session=True, env={**os.environ, "NO_COLOR": "1", **environment})
    lines: list[str] = []

    def read():
        for line in server.stdout:
            lines.append(line)

    threading.Thread(target=read, daemon=True).start()
    return server, lines


def wait_ready(server, lines: list[str], port: int, replicas: bool, limit_s: float = 300) -> float:
    """Seconds until the server serves: its announcement (replicas) or /health answering (one process)."""
    started, deadline = time.monotonic(), time.monotonic() + limit_s
    while True:
        if replicas and any(re.match(r"dlmrt serve: \d+ replicas? ", line) for line in lines):
            return time.monotonic() - started
        if not replicas:
            try:
                if httpx.get(f"http://127.0.0.1:{port}/health", timeout=1).status_code == 200:
                    return time.monotonic() - started
            except httpx.TransportError:
                pass
        if server.poll() is not None or time.monotonic() > deadline:
            raise click.ClickException(f"the server did not start:\n{''.join(lines)[-3000:]}")
        time.sleep(0.2)


def stop(server) -> tuple[int, float]:
    """SIGTERM, then (exit status, seconds to exit); killed with its process group past a minute."""
    started = time.monotonic()
    server.send_signal(signal.SIGTERM)
    try:
        status = server.wait(60)
    except subprocess.TimeoutExpired:
        status = None
    stopped_s = time.monotonic() - started
    try:
        os.killpg(server.pid, signal.SIGKILL)  # what Ray left behind, if anything
    except ProcessLookupError:
        pass
    server.wait()
    return (server.returncode if status is None else status), stopped_s


def one_run(name: str, requests: int, concurrency: int) -> dict:
    options, environment = SERVERS[name]
    port = free_port()
    server, lines = serve(options, environment, port)
    try:
        ready_s = wait_ready(server, lines, port, replicas=bool(options))
        with tempfile.TemporaryDirectory() as scratch:
            report_path = Path(scratch) / "load.json"
            subprocess.run([sys.executable, str(LOAD_TEST), "--url", f"http://127.0.0.1:{port}", "--requests",
                            str(requests), "--concurrency", str(concurrency), "--json", str(report_path)],
                           stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, timeout=900)
            report = json.loads(report_path.read_text())["concurrent"]
    finally:
        status, stopped_s = stop(server)
    return {"server": name, "ready_s": ready_s, "stopped_s": stopped_s, "exit_status": status, **report}


def spread(values: list[float], scale: float = 1.0, digits: int = 1) -> str:
    """The median, with the range in brackets."""
    low, mid, high = (round(v * scale, digits) for v in (min(values), statistics.median(values), max(values)))
    return f"{mid:.{digits}f} ({low:.{digits}f}-{high:.{digits}f})"


def table(runs: list[dict], names: list[str]) -> str:
    by = {name: [run for run in runs if run["server"] == name] for name in names}
    rows = [
        ("answered requests/s", lambda rs: spread([r["requests_per_s"] for r in rs])),
        ("completion tokens/s", lambda rs: spread([r["completion_tokens_per_s"] for r in rs], digits=0)),
        ("latency p50 (ms)", lambda rs: spread([r["latency_s"]["p50"] for r in rs], 1000, 0)),
        ("latency p99 (ms)", lambda rs: spread([r["latency_s"]["p99"] for r in rs], 1000, 0)),
        ("first block p50 / p99 (ms)", lambda rs: " / ".join(spread([r["first_block_s"][p] for r in rs], 1000, 0)
                                                             for p in ("p50", "p99"))),
        ("answered + cancelled, refused, lost (each run)",
         lambda rs: ", ".join(sorted({f"{r['answered']} + {r['cancelled']}, {r['refused']}, {r['lost']}"
                                      for r in rs}))),
        ("ready after (s)", lambda rs: spread([r["ready_s"] for r in rs])),
        ("exit after SIGTERM (s), status", lambda rs: f"{spread([r['stopped_s'] for r in rs])}, "
                                                      f"{', '.join(sorted({str(r['exit_status']) for r in rs}))}"),
    ]
    lines = ["| | " + " | ".join(names) + " |", "|---" * (len(names) + 1) + "|"]
    lines += [f"| {label} | " + " | ".join(show(by[name]) for name in names) + " |" for label, show in rows]
    return "\n".join(lines)


def ratios(runs: list[dict], top: str, bottom: str) -> list[float]:
    """`top` over `bottom` in answered requests/s, run by run."""
    count = len(runs) // len({run["server"] for run in runs})
    value = {(run["server"], run["run"]): run["requests_per_s"] for run in runs}
    return [value[top, n] / value[bottom, n] for n in range(count)]


@click.command(help=__doc__.split("\n\n")[0])
@click.option("--runs", type=click.IntRange(1), default=3, show_default=True, help="Runs of each server.")
@click.option("--requests", type=click.IntRange(1), default=1000, show_default=True)
@click.option("--concurrency", type=click.IntRange(1), default=64, show_default=True)
@click.option("--without-single", is_flag=True, help="Leave out the single-process server.")
@click.option("--json", "json_path", type=click.Path(dir_okay=False, path_type=Path), default=None,
              help="Also write every run here.")
def main(runs, requests, concurrency, without_single, json_path):
    names = [name for name in SERVERS if not (without_single and name == "one process, no Ray")]
    results = []
    for n in range(runs):
        for name in names[n % len(names):] + names[:n % len(names)]:  # the order turns with every run
            result = {"run": n, **one_run(name, requests, concurrency)}
            results.append(result)
            click.echo(f"run {n + 1}, {name}: {result['requests_per_s']:.1f} answered requests/s, "
                       f"{result['lost']} lost, ready after {result['ready_s']:.1f} s, exit "
                       f"{result['exit_status']} after {result['stopped_s']:.1f} s", err=True)
    click.echo(table(results, names))
    scaling = ratios(results, "2 replicas", "1 replica")
    click.echo(f"\n2 replicas / 1 replica, answered requests/s: {spread(scaling, digits=2)}x (median of the runs' "
               f"ratios, their range in brackets)")
    if json_path is not None:
        json_path.write_text(json.dumps({"settings": {"runs": runs, "requests": requests, "concurrency": concurrency},
                                         "runs": results, "ratio_2_over_1": scaling}, indent=2))
    failed = [r for r in results if r["lost"] or r["exit_status"] != 0]
    if failed:
        click.echo(f"{len(failed)} run(s) lost requests or did not exit cleanly", err=True)
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
