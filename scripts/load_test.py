"""Load test for `dlmrt serve`: many completions at once, streamed or not, some closed early by the client.

    dlmrt serve --port 8000 &
    python scripts/load_test.py --requests 1000 --concurrency 64 --sequential 50 --json load.json

Requests are task-suite prompts (dlmrt.core.tasks, held-out split), drawn with --seed. Exactly
round(N * --stream-fraction) of them stream, and round(N * --cancel-fraction) of those are closed by
the client after their first event. Each request ends as exactly one of:

- answered: 200 with a whole completion, or a stream that ended with `data: [DONE]`, its last chunk
  carrying a finish_reason;
- cancelled: a stream this script closed on purpose after its first event;
- refused: an OpenAI error object (4xx/5xx, or an error event mid-stream), counted by `error.code`
  (or by status where the code is null);
- lost: a connection error, a timeout, a malformed response (a completion without a finish_reason too),
  a stream without `[DONE]`, or a request still in flight (or never sent) when --time-limit passed.

--hostile-fraction F makes round(N * F) of the requests (drawn from those that do not stream) hostile
clients, in turn of three kinds, each on its own raw connection: "stalled" sends its headers and half its
body, then nothing; "oversized" declares a body of --hostile-body-bytes and sends it; "chunked" sends that
many bytes chunked, never ending the body. A hostile request is counted apart from the normal ones, by
kind and by what the server did: the status it answered (the server's limits say 408 for stalled, 413 for
the others), "reset" (the server closed on a client still sending, before the answer could be read),
"closed" (no answer), or "no answer" (none by --time-limit). The normal requests' counts, latencies and
throughput are the phase's; `hostile_unanswered` counts the hostile clients the server never cut off.

Throughput counts the completion tokens and the requests of answered requests over the wall time of a
phase. Latency is from sending to the last byte (answered requests); time to first block is from
sending to the first data event (streaming requests that got a completion chunk). --sequential N first
runs the first N requests of the same mix one at a time, as the baseline of the concurrent/sequential
ratio (hostile requests never run there). The server must be on loopback. The exit status is 1 when any
normal request was lost or any hostile one got no answer.
"""

from __future__ import annotations

import asyncio
import ipaddress
import json
import math
import random
import sys
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

import click
import httpx
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from dlmrt.core import atomic, tasks

OUTCOMES = ("answered", "cancelled", "refused", "lost")
HOSTILE_KINDS = ("stalled", "oversized", "chunked")
EXPECTED = {"stalled": ("408",), "oversized": ("413", "reset"), "chunked": ("413", "reset")}  # what limits do
CHUNK = 64 * 1024


@dataclass(frozen=True)
class PlannedRequest:
    prompt: str
    stream: bool
    cancel: bool  # close the stream after its first event
    hostile: str | None = None  # one of HOSTILE_KINDS


@dataclass
class Result:
    outcome: str  # one of OUTCOMES
    reason: str | None = None  # why refused or lost
    completion_tokens: int = 0
    latency_s: float | None = None  # answered: send to last byte
    first_block_s: float | None = None  # streams: send to the first completion chunk


def check_loopback(ctx, param, url: str) -> str:
    """Refuse a URL whose host is not loopback: this tool floods what it points at."""
    try:
        parsed = httpx.URL(url)
    except httpx.InvalidURL as error:
        raise click.BadParameter(f"{url!r} is not a URL ({error})") from None
    if parsed.scheme not in ("http", "https"):
        raise click.BadParameter(f"{url!r}: the scheme must be http or https")
    host = parsed.host.lower()
    try:
        loopback = ipaddress.ip_address(host).is_loopback
    except ValueError:
        loopback = host == "localhost"
    if not loopback:
        raise click.BadParameter(f"the host {parsed.host!r} is not loopback: load tests run only against "
                                 f"127.0.0.1, ::1 or localhost")
    return str(parsed).rstrip("/")


def plan_requests(count: int, stream_fraction: float, cancel_fraction: float, seed: int,
                  hostile_fraction: float = 0.0) -> list[PlannedRequest]:
    """`count` task-suite prompts; exact shares of them stream, are cancelled and (of those that do not
    stream) are hostile, in turn of each kind, placed at random."""
    rng = random.Random(seed)
    prompts = [tasks.sample(rng.choice(tuple(tasks.TASKS)), "test", rng).prompt for _ in range(count)]
    chosen = rng.sample(range(count), round(count * stream_fraction))
    streaming, cancelled = set(chosen), set(chosen[:round(count * cancel_fraction)])
    others = [i for i in range(count) if i not in streaming]
    hostile = {i: HOSTILE_KINDS[n % 3] for n, i in enumerate(rng.sample(others, round(count * hostile_fraction)))}
    return [PlannedRequest(prompt, i in streaming, i in cancelled, hostile.get(i)) for i, prompt in enumerate(prompts)]


def refusal(response: httpx.Response, body: bytes) -> Result:
    """An error status: refused when the body is an OpenAI error object, else lost."""
    try:
        error = json.loads(body)["error"]
        code = error.get("code") or f"http {response.status_code}"
    except (ValueError, KeyError, TypeError, AttributeError):
        return Result("lost", f"malformed error response (http {response.status_code})")
    return Result("refused", str(code))


async def complete(client: httpx.AsyncClient, model: str, request: PlannedRequest, max_tokens: int) -> Result:
    """Send one request and classify how it ended."""
    body = {"model": model, "prompt": request.prompt, "max_tokens": max_tokens, "stream": request.stream}
    started = time.perf_counter()
    try:
        if request.stream:
            return await read_stream(client, body, request.cancel, started)
        response = await client.post("/v1/completions", json=body)
        if response.status_code != 200:
            return refusal(response, response.content)
        try:
            choice = response.json()["choices"][0]
            tokens, finished = len(choice["token_ids"]), choice["finish_reason"] is not None
        except (ValueError, KeyError, IndexError, TypeError):
            return Result("lost", "malformed response")
        if not finished:
            return Result("lost", "no finish_reason")
        return Result("answered", completion_tokens=tokens, latency_s=time.perf_counter() - started)
    except httpx.TimeoutException:
        return Result("lost", "timeout")
    except httpx.HTTPError as error:
        return Result("lost", type(error).__name__)


async def read_stream(client: httpx.AsyncClient, body: dict, cancel: bool, started: float) -> Result:
    """Read server-sent events to `[DONE]`, or close the stream after the first one when `cancel`."""
    tokens, first_block_s, finished = 0, None, False
    async with client.stream("POST", "/v1/completions", json=body) as response:
        if response.status_code != 200:
            return refusal(response, await response.aread())
        async for line in response.aiter_lines():
            if not line.startswith("data: "):
                continue
            data = line.removeprefix("data: ")
            if data == "[DONE]":
                if not finished:  # a server that failed mid-decode may still close the stream properly
                    return Result("lost", "[DONE] without finish_reason")
                return Result("answered", completion_tokens=tokens, latency_s=time.perf_counter() - started,
                              first_block_s=first_block_s)
            try:
                event = json.loads(data)
                if "error" in event:
                    return Result("refused", str(event["error"].get("code") or "error event"))
                choice = event["choices"][0]
                tokens += len(choice["token_ids"])
                finished = choice["finish_reason"] is not None
            except (ValueError, KeyError, IndexError, TypeError, AttributeError):
                return Result("lost", "malformed event")
            if first_block_s is None:
                first_block_s = time.perf_counter() - started
            if cancel:
                return Result("cancelled", completion_tokens=tokens, first_block_s=first_block_s)
    return Result("lost", "stream ended without [DONE]")


async def hostile(url: str, model: str, request: PlannedRequest, body_bytes: int) -> Result:
    """One hostile client on its own connection (see the module's doc); its `reason` is what the server did."""
    address = httpx.URL(url)
    reader, writer = await asyncio.open_connection(address.host, address.port)
    head = f"POST /v1/completions HTTP/1.1\r\nhost: {address.host}\r\ncontent-type: application/json\r\n"
    payload = json.dumps({"model": model, "prompt": request.prompt}).encode()
    answered = asyncio.ensure_future(reader.readline())  # the status line, whenever it comes
    try:
        try:
            if request.hostile == "stalled":
                writer.write(f"{head}content-length: {len(payload)}\r\n\r\n".encode() + payload[:len(payload) // 2])
            else:
                chunked = request.hostile == "chunked"
                framing = "transfer-encoding: chunked" if chunked else f"content-length: {body_bytes}"
                writer.write(f"{head}{framing}\r\n\r\n".encode())
                piece = b"1" * CHUNK
                for _ in range(-(-body_bytes // CHUNK)):
                    if answered.done():
                        break
                    writer.write(b"%x\r\n%s\r\n" % (CHUNK, piece) if chunked else piece)
                    await writer.drain()
        except (ConnectionResetError, BrokenPipeError):
            pass  # the server stopped reading: its answer may still be there
        line = await answered
        what = line.split()[1].decode() if line.startswith(b"HTTP/") else "closed"
    except (ConnectionResetError, BrokenPipeError):
        what = "reset"
    finally:
        answered.cancel()
        writer.close()
    return Result("hostile", f"{request.hostile}: {what}")


async def run_phase(client: httpx.AsyncClient, model: str, requests: list[PlannedRequest], concurrency: int,
                    max_tokens: int, deadline: float, progress: Progress, label: str,
                    hostile_body_bytes: int = 0) -> tuple[list[Result], float]:
    """Every request's result, in order, and the phase's wall time. At `deadline` the phase stops: what is
    in flight or not yet sent is lost."""
    gate = asyncio.Semaphore(concurrency)
    results: list[Result | None] = [None] * len(requests)
    sent = [False] * len(requests)
    bar = progress.add_task(label, total=len(requests))

    async def one(index: int) -> None:
        async with gate:
            if time.monotonic() >= deadline:
                return
            sent[index] = True
            if requests[index].hostile:
                results[index] = await hostile(str(client.base_url), model, requests[index], hostile_body_bytes)
            else:
                results[index] = await complete(client, model, requests[index], max_tokens)
            progress.advance(bar)

    started = time.perf_counter()
    running = [asyncio.create_task(one(i)) for i in range(len(requests))]
    _, unfinished = await asyncio.wait(running, timeout=max(0.0, deadline - time.monotonic()))
    for task in unfinished:
        task.cancel()
    await asyncio.gather(*unfinished, return_exceptions=True)
    wall_s = time.perf_counter() - started
    return [result or (Result("hostile", f"{request.hostile}: no answer") if request.hostile else
                       Result("lost", "in flight at the time limit" if was_sent else "not sent before the time limit"))
            for result, was_sent, request in zip(results, sent, requests)], wall_s


def percentile(values: list[float], share: float) -> float | None:
    """Nearest-rank percentile (`share` in 0..100), None without values."""
    if not values:
        return None
    ordered = sorted(values)
    return ordered[max(0, math.ceil(share / 100 * len(ordered)) - 1)]


def summarize(results: list[Result], wall_s: float, concurrency: int) -> dict:
    """A phase's counts, reasons, throughput and percentiles (the JSON report's `concurrent`/`sequential`)."""
    counts = Counter(result.outcome for result in results)
    answered = [result for result in results if result.outcome == "answered"]
    tokens = sum(result.completion_tokens for result in answered)
    latencies = [result.latency_s for result in answered]
    first_blocks = [result.first_block_s for result in results if result.first_block_s is not None]
    return {
        "requests": len(results), "concurrency": concurrency, **{outcome: counts[outcome] for outcome in OUTCOMES},
        "refused_by_reason": dict(Counter(r.reason for r in results if r.outcome == "refused").most_common()),
        "lost_by_reason": dict(Counter(r.reason for r in results if r.outcome == "lost").most_common()),
        "wall_s": wall_s, "completion_tokens": tokens,
        "completion_tokens_per_s": tokens / wall_s if wall_s > 0 else 0.0,
        "requests_per_s": len(answered) / wall_s if wall_s > 0 else 0.0,
        "latency_s": {"p50": percentile(latencies, 50), "p99": percentile(latencies, 99)},
        "first_block_s": {"p50": percentile(first_blocks, 50), "p99": percentile(first_blocks, 99)},
    }


def summarize_hostile(results: list[Result]) -> dict:
    """The hostile requests by kind and by what the server did, and how many it never cut off."""
    by_kind: dict[str, Counter] = {kind: Counter() for kind in HOSTILE_KINDS}
    for result in results:
        kind, _, what = result.reason.partition(": ")
        by_kind[kind][what] += 1
    return {"requests": len(results), "by_kind": {kind: dict(seen) for kind, seen in by_kind.items() if seen},
            "unexpected": sum(n for kind, seen in by_kind.items() for what, n in seen.items()
                              if what not in EXPECTED[kind]),
            "unanswered": sum(seen["no answer"] for seen in by_kind.values())}


def ratio(concurrent: dict, sequential: dict | None) -> dict | None:
    """Concurrent throughput over sequential, per measure (None where the baseline is zero)."""
    if sequential is None:
        return None
    return {key: concurrent[key] / sequential[key] if sequential[key] else None
            for key in ("completion_tokens_per_s", "requests_per_s")}


def report_table(report: dict) -> Table:
    """One column per phase run."""
    phases = {"concurrent": report["concurrent"], "sequential": report["sequential"]}
    phases = {name: phase for name, phase in phases.items() if phase is not None}
    table = Table(title=f"dlmrt serve load test: {report['model']} at {report['url']}")
    table.add_column("")
    for name, phase in phases.items():
        table.add_column(f"{name} (concurrency {phase['concurrency']})", justify="right")

    def row(label: str, show) -> None:
        table.add_row(label, *(show(phase) for phase in phases.values()))

    def milliseconds(seconds: float | None) -> str:
        return "n/a" if seconds is None else f"{seconds * 1000:.1f}"

    row("requests", lambda p: str(p["requests"]))
    for outcome in OUTCOMES:
        row(outcome, lambda p, outcome=outcome: str(p[outcome]))
        if outcome in ("refused", "lost"):
            reasons = sorted({reason for p in phases.values() for reason in p[f"{outcome}_by_reason"]})
            for reason in reasons:
                row(f"  {reason}", lambda p, outcome=outcome, reason=reason: str(
                    p[f"{outcome}_by_reason"].get(reason, 0)))
    row("answered + cancelled + refused + lost", lambda p: " + ".join(str(p[o]) for o in OUTCOMES)
        + f" = {sum(p[o] for o in OUTCOMES)}")
    row("wall time (s)", lambda p: f"{p['wall_s']:.2f}")
    row("completion tokens", lambda p: str(p["completion_tokens"]))
    row("completion tokens/s", lambda p: f"{p['completion_tokens_per_s']:.1f}")
    row("answered requests/s", lambda p: f"{p['requests_per_s']:.2f}")
    row("latency p50 / p99 (ms)", lambda p: f"{milliseconds(p['latency_s']['p50'])} / "
                                            f"{milliseconds(p['latency_s']['p99'])}")
    row("first block p50 / p99 (ms, streams)", lambda p: f"{milliseconds(p['first_block_s']['p50'])} / "
                                                         f"{milliseconds(p['first_block_s']['p99'])}")
    if report.get("hostile"):
        found = report["hostile"]
        table.add_row("hostile requests (apart from the above)", str(found["requests"]))
        for kind, seen in found["by_kind"].items():
            table.add_row(f"  {kind} ({' or '.join(EXPECTED[kind])} expected)",
                          ", ".join(f"{what}: {n}" for what, n in sorted(seen.items())))
        table.add_row("  unexpected / no answer", f"{found['unexpected']} / {found['unanswered']}")
    if report["throughput_ratio"] is not None:
        shown = {key: "n/a" if value is None else f"{value:.2f}x" for key, value in report["throughput_ratio"].items()}
        table.caption = (f"concurrent / sequential: {shown['completion_tokens_per_s']} completion tokens/s, "
                         f"{shown['requests_per_s']} requests/s")
    return table


async def load_test(url: str, requests: list[PlannedRequest], concurrency: int, sequential: int, max_tokens: int,
                    time_limit: float, progress: Progress, hostile_body_bytes: int = 0) -> dict:
    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
    # a request's own limit is the run's: --time-limit is what cuts a stalled server off
    timeout = httpx.Timeout(time_limit, connect=10.0)
    async with httpx.AsyncClient(base_url=url, limits=limits, timeout=timeout, trust_env=False) as client:
        try:
            listed = (await client.get("/v1/models")).raise_for_status().json()
            model = listed["data"][0]["id"]
        except (httpx.HTTPError, ValueError, KeyError, IndexError, TypeError) as error:
            raise click.ClickException(f"no model list from {url}/v1/models ({type(error).__name__}: {error}): "
                                       f"is `dlmrt serve` running there?") from None
        deadline = time.monotonic() + time_limit
        baseline = None
        if sequential:
            normal = [request for request in requests[:sequential] if not request.hostile]
            results, wall_s = await run_phase(client, model, normal, 1, max_tokens, deadline, progress, "sequential")
            baseline = summarize(results, wall_s, 1)
        results, wall_s = await run_phase(client, model, requests, concurrency, max_tokens, deadline, progress,
                                          "concurrent", hostile_body_bytes)
        concurrent = summarize([r for r in results if r.outcome != "hostile"], wall_s, concurrency)
        hostile_results = [r for r in results if r.outcome == "hostile"]
    return {"url": url, "model": model, "time_limit_reached": time.monotonic() >= deadline,
            "concurrent": concurrent, "sequential": baseline, "throughput_ratio": ratio(concurrent, baseline),
            "hostile": summarize_hostile(hostile_results) if hostile_results else None}


@click.command(help=__doc__.split("\n\n")[0])
@click.option("--url", default="http://127.0.0.1:8000", show_default=True, callback=check_loopback,
              help="The server's base URL (loopback only).")
@click.option("--requests", "request_count", type=click.IntRange(1), default=1000, show_default=True,
              help="Requests of the concurrent run.")
@click.option("--concurrency", type=click.IntRange(1), default=64, show_default=True,
              help="Requests in flight at once.")
@click.option("--stream-fraction", type=click.FloatRange(0, 1), default=0.5, show_default=True,
              help="Share of the requests that stream.")
@click.option("--cancel-fraction", type=click.FloatRange(0, 1), default=0.05, show_default=True,
              help="Share of the requests (all streaming) that the client closes after their first event.")
@click.option("--max-tokens", type=click.IntRange(1), default=16, show_default=True,
              help="max_tokens of every request.")
@click.option("--seed", type=int, default=0, show_default=True, help="Draws the prompts and the mix.")
@click.option("--time-limit", type=click.FloatRange(min=0, min_open=True), default=600.0, show_default=True,
              help="Seconds for the whole run; past it nothing more is sent and what is outstanding is lost.")
@click.option("--sequential", type=click.IntRange(0), default=0, show_default=True,
              help="First run the first N requests one at a time, as the throughput baseline.")
@click.option("--hostile-fraction", type=click.FloatRange(0, 1), default=0.0, show_default=True,
              help="Share of the requests (none streaming) sent by hostile clients: stalled, oversized, chunked.")
@click.option("--hostile-body-bytes", type=click.IntRange(1), default=(2 << 20) + 1, show_default=True,
              help="The body the oversized and chunked hostile clients send (over the server's limit).")
@click.option("--json", "json_path", type=click.Path(dir_okay=False, path_type=Path), default=None,
              help="Also write the report here.")
def main(url, request_count, concurrency, stream_fraction, cancel_fraction, max_tokens, seed, time_limit, sequential,
         hostile_fraction, hostile_body_bytes, json_path):
    if round(request_count * cancel_fraction) > round(request_count * stream_fraction):
        raise click.BadParameter("more requests to cancel than streaming requests: lower it, or raise "
                                 "--stream-fraction", param_hint="--cancel-fraction")
    if sequential > request_count:
        raise click.BadParameter(f"{sequential} is more than --requests ({request_count})", param_hint="--sequential")
    if round(request_count * hostile_fraction) > request_count - round(request_count * stream_fraction):
        raise click.BadParameter("more hostile requests than requests that do not stream: lower it, or lower "
                                 "--stream-fraction", param_hint="--hostile-fraction")
    requests = plan_requests(request_count, stream_fraction, cancel_fraction, seed, hostile_fraction)
    columns = (TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn())
    with Progress(*columns, console=Console(stderr=True), transient=True) as progress:
        report = asyncio.run(load_test(url, requests, concurrency, sequential, max_tokens, time_limit, progress,
                                       hostile_body_bytes))
    report["settings"] = {"requests": request_count, "concurrency": concurrency, "stream_fraction": stream_fraction,
                          "cancel_fraction": cancel_fraction, "max_tokens": max_tokens, "seed": seed,
                          "time_limit_s": time_limit, "sequential": sequential, "hostile_fraction": hostile_fraction,
                          "hostile_body_bytes": hostile_body_bytes}
    Console(width=None if sys.stdout.isatty() else 120).print(report_table(report))
    if json_path is not None:
        atomic.write_text(json_path, json.dumps(report, indent=2))
    lost = report["concurrent"]["lost"] + (report["sequential"] or {"lost": 0})["lost"]
    unanswered = (report["hostile"] or {"unanswered": 0})["unanswered"]
    if lost:
        click.echo(f"{lost} request(s) lost", err=True)
    if unanswered:
        click.echo(f"{unanswered} hostile client(s) never cut off by the server", err=True)
    sys.exit(1 if lost or unanswered else 0)


if __name__ == "__main__":
    main()
