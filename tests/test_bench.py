"""`dlmrt bench`: cases side by side, the figures people compare, and one line for bad input."""

from __future__ import annotations

import json

import pytest
from click.testing import CliRunner

from dlmrt.cli import main


def bench(*args):
    return CliRunner().invoke(main, ["bench", *map(str, args)])


def test_backends_and_modes_side_by_side_give_the_same_tokens(tmp_path):
    pytest.importorskip("onnxruntime")
    out = tmp_path / "bench.json"
    result = bench("--backend", "torch:eager,torch:compile,ort", "--batch-size", 2, "--input-len", 8, "--output-len",
                   16, "--block-length", 8, "--num-iters", 2, "--output-json", out)
    assert result.exit_code == 0, result.output
    document = json.loads(out.read_text())
    assert document["format_version"] == 1 and document["model"] == "tiny-llada"
    assert document["request"] == {"batch_size": 2, "input_len": 8, "output_len": 16, "seed": 0}
    assert {"cpu", "threads", "torch", "onnxruntime"} <= set(document["environment"])
    cases = document["cases"]
    assert [c["setting"] for c in cases] == ["torch:eager", "torch:compile", "ort"]
    assert len({c["tokens_sha256"] for c in cases}) == 1 and all(c["same_tokens"] for c in cases)
    for case in cases:
        assert case["nfe"] > 0 and case["tpf"] >= 1
        assert 0 < case["latency_p50_s"] <= case["latency_p90_s"] and 0 < case["step_p50_s"] <= case["step_p90_s"]
        assert case["peak_memory_bytes"] > 0
    assert "torch:compile" in result.output and "tokens/s" in result.output


def test_a_named_random_config_needs_no_download(tmp_path):
    out = tmp_path / "bench.json"
    result = bench("--model", "llada2-moe-small", "--input-len", 8, "--output-len", 8, "--num-iters", 1,
                   "--num-iters-warmup", 0, "--policy", "llada2", "--output-json", out)
    assert result.exit_code == 0, result.output
    document = json.loads(out.read_text())
    assert document["model"] == "llada2-moe-small" and document["settings"]["threshold"] == 0.95
    again = tmp_path / "again.json"
    assert bench("--model", "llada2-moe-small", "--input-len", 8, "--output-len", 8, "--num-iters", 1,
                 "--num-iters-warmup", 0, "--policy", "llada2", "--output-json", again).exit_code == 0
    assert json.loads(again.read_text())["cases"][0]["tokens_sha256"] == document["cases"][0]["tokens_sha256"]


@pytest.mark.parametrize("args, message", [
    (["--backend", "tensorflow"], "unknown backend 'tensorflow'"),
    (["--backend", "torch:fast"], "unknown backend 'torch:fast'"),
    (["--backend", "torch,torch:auto"], "names a backend twice"),
    (["--model", "llada-9000"], "is neither a model directory nor a random config"),
    (["--num-iters", "0"], "'--num-iters': 0 is not in the range"),
    (["--output-len", "12", "--block-length", "8"], "gen-length (12) must be divisible by block-length (8)"),
])
def test_bad_input_is_one_line(args, message):
    result = bench(*args)
    assert result.exit_code == 2 and message in result.output and "Traceback" not in result.output, result.output
