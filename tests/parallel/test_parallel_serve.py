"""Serving a model split over ranks: rank 0's scheduler decides, every other rank replays its batches
(dlmrt.parallel.lockstep), so requests that join running batches, wait for a batch of their own settings,
or are cancelled mid-block get the tokens (and logprobs) one process gives them; `dlmrt serve --tp 2`
answers as `dlmrt serve` does, stops cleanly, and ends with one line when a rank dies."""

from __future__ import annotations

import os
import signal
from pathlib import Path

import pytest

import jobs_serve
import jobs_tp
from dlmrt.parallel.launch import run_ranks
from dlmrt.parallel.plan import ParallelPlan
from dlmrt.runtime import EntropyBound, GenerationSettings, Threshold
from live_server import dlmrt_serve


MASKED = [
    jobs_serve.Request("add:762+139=", GenerationSettings(16, 8, Threshold(0.5), seed=1)),
    jobs_serve.Request("rev:hello=", GenerationSettings(32, 8, Threshold(0.5), seed=2, temperature=0.7),
                       cancel_after_first_block=True),
    # its own batch: the cache differs, so it waits for the first batch to end
    jobs_serve.Request("sort:dcba=", GenerationSettings(16, 8, Threshold(0.5), seed=3, cache="prefix")),
    jobs_serve.Request("add:12+34=", GenerationSettings(16, 8, Threshold(0.5), seed=4, logprobs=3)),
]
UNIFORM = [
    jobs_serve.Request("sort:3142=", GenerationSettings(24, 8, EntropyBound(steps=12), seed=0, ignore_eos=True)),
    jobs_serve.Request("add:12+34=", GenerationSettings(32, 8, EntropyBound(steps=12), seed=1, ignore_eos=True),
                       cancel_after_first_block=True),
    jobs_serve.Request("add:5+6=", GenerationSettings(16, 8, EntropyBound(steps=12), seed=2)),
]


@pytest.mark.slow
@pytest.mark.parametrize("make_model, requests", [(jobs_tp.tiny_llada, MASKED),
                                                  (jobs_tp.tiny_diffusion_gemma, UNIFORM)],
                         ids=["llada", "diffusion-gemma"])
def test_a_follower_replays_rank_0s_batches_and_every_request_gets_its_one_process_tokens(make_model, requests):
    alone = jobs_serve.scheduled(None, make_model, None, requests)
    leader, follower = run_ranks(jobs_serve.scheduled, 2, (make_model, ParallelPlan(tp=2), requests))
    assert leader["events"] == alone["events"]
    assert follower["runs"] == leader["runs"] == alone["runs"]
    cancelled = [events[-1][2] for events, request in zip(alone["events"], requests)
                 if request.cancel_after_first_block]
    assert cancelled == ["cancelled"]  # the cancel reached rank 0's batch mid-request, and the follower's with it
    asked = [request.settings.logprobs is not None for request in requests]
    assert [bool(entries) for entries in alone["logprobs"]] == asked
    for split_entries, alone_entries in zip(leader["logprobs"], alone["logprobs"]):
        assert same_logprobs(split_entries, alone_entries)


def same_logprobs(ours, expected, tolerance=1e-5) -> bool:
    """The same alternatives, and every log-probability within `tolerance`, relative below -1 (the ranks sum
    in another order, and split layers fall below the size the CPU path packs for oneDNN)."""
    def close(x: float, y: float) -> bool:
        return abs(x - y) <= tolerance * max(1.0, abs(y))

    return len(ours) == len(expected) and all(
        close(a, b) and [t for t, _ in top_a] == [t for t, _ in top_b]
        and all(close(x, y) for (_, x), (_, y) in zip(top_a, top_b))
        for (a, top_a), (b, top_b) in zip(ours, expected))


BODIES = [{"prompt": prompt, "temperature": temperature, "seed": seed, "max_tokens": 16, "logprobs": logprobs}
          for seed, (prompt, temperature, logprobs) in enumerate([
              ("add:762+139=", 0.0, None), ("rev:hello=", 0.0, 2), ("sort:dcba=", 0.8, None), ("add:12+34=", 0.8, 0),
              ("rev:abc=", 0.0, None), ("sort:3142=", 0.0, None)])]


def answers(port: int) -> tuple:
    """BODIES sent at once, and the first one streamed: each reply's text, finish reason and logprobs, and
    the stream's event count."""
    import asyncio

    import httpx

    async def ask():
        async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}", timeout=60) as client:
            replies = await asyncio.gather(*[client.post("/v1/completions", json={"model": "tiny-llada", **body})
                                             for body in BODIES])
            streamed = await client.post("/v1/completions", json={"model": "tiny-llada", **BODIES[0], "stream": True})
        choices = [reply.json()["choices"][0] for reply in replies]
        return [(c["text"], c["finish_reason"]) for c in choices], [c["logprobs"] for c in choices], \
            streamed.text.count("data: ")

    return asyncio.run(ask())


def rank_processes(pid: int) -> list[int]:
    from test_parallel_cli import children

    return [child for child in children(pid) if "spawn_main" in Path(f"/proc/{child}/cmdline").read_text()]


@pytest.mark.slow
@pytest.mark.skipif(not Path("/proc/self/task").exists(), reason="finds the ranks through /proc (Linux)")
def test_serve_tp_2_answers_as_one_process_does_and_stops_cleanly_on_sigterm():
    import httpx

    with dlmrt_serve() as (_, alone_port):
        texts, logprobs, streamed = answers(alone_port)
    with dlmrt_serve("--tp", "2") as (server, port):
        followers = rank_processes(server.pid)
        assert len(followers) == 1
        split_texts, split_logprobs, split_streamed = answers(port)
        assert (split_texts, split_streamed) == (texts, streamed)
        for ours, expected, body in zip(split_logprobs, logprobs, BODIES):
            assert (ours is None) == (body["logprobs"] is None)
            if ours is not None:
                assert ours["tokens"] == expected["tokens"] and ours["text_offset"] == expected["text_offset"]
                assert [list(top) for top in ours["top_logprobs"]] == [list(top) for top in expected["top_logprobs"]]
                assert ours["token_logprobs"] == pytest.approx(expected["token_logprobs"], abs=1e-5)
                assert [v for top in ours["top_logprobs"] for v in top.values()] == pytest.approx(
                    [v for top in expected["top_logprobs"] for v in top.values()], abs=1e-5)
        scored = httpx.post(f"http://127.0.0.1:{port}/v1/completions",
                            json={"model": "tiny-llada", "prompt": "add:1+2=", "echo": True, "max_tokens": 0,
                                  "logprobs": 1})
        assert scored.status_code == 400
        assert "scoring a text is not built for a model split over ranks" in scored.json()["error"]["message"]
        server.send_signal(signal.SIGTERM)
        assert server.wait(30) == 0, server.stdout.read().decode()[-2000:]
        assert not any(Path(f"/proc/{pid}").exists() and "zombie" not in Path(f"/proc/{pid}/status").read_text()
                       for pid in followers)


@pytest.mark.slow
@pytest.mark.skipif(not Path("/proc/self/task").exists(), reason="finds the ranks through /proc (Linux)")
def test_a_rank_that_dies_ends_the_server_with_one_line():
    with dlmrt_serve("--tp", "2") as (server, _):
        os.kill(rank_processes(server.pid)[0], signal.SIGKILL)
        assert server.wait(30) == 2
        output = server.stdout.read().decode()
    assert output.strip().splitlines()[-1] == "Error: rank 1 was killed by SIGKILL; every rank of 2 was stopped"
    assert "Traceback" not in output and "Warning" not in output
