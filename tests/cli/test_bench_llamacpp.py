"""scripts/bench_llamacpp.py without llama.cpp (which CI cannot install): it skips with the reason, reads
llama-diffusion-cli's log as the CLI prints it (a recording fake stands in for the binary), and builds
the checkpoint and the exact-length prompt both tools get."""

from __future__ import annotations

import importlib.util
import os
import stat
from pathlib import Path

import pytest

SCRIPT = Path(__file__).parents[2] / "scripts" / "bench_llamacpp.py"
# llama-diffusion-cli's log, as it prints it: prefixed lines, progress lines joined by carriage returns,
# then the total time and the decoded output.
LOG = ("0.00.015.463 I diffusion_params: - mask_token_id             llama_token      = 2047\n"
       "0.00.015.518 I diffusion step: 0/160 [   ] 0%\r0.00.060.075 I diffusion step: 1/160 [   ] 0%"
       "\r0.00.088.286 I diffusion step: 2/160 [=  ] 1%\r0.00.116.031 I diffusion step: 32/160 [==  ] 20%\n"
       "0.02.303.186 I \ntotal time: 2287.66ms, time per step: 14.30ms, sampling time per step: 0.06ms\n"
       "0.02.303.301 I \nhello out there\n")


@pytest.fixture(scope="module")
def script():
    spec = importlib.util.spec_from_file_location("bench_llamacpp", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_log_gives_the_time_the_forwards_and_the_text(script):
    seconds, forwards, text = script.parse_cli_log(LOG)
    assert seconds == pytest.approx(2.28766) and forwards == 4 and text == "hello out there"


def test_a_log_without_a_total_time_is_an_error_that_shows_the_log(script):
    with pytest.raises(RuntimeError, match="printed no total time:\n.*mask_token_id"):
        script.parse_cli_log(LOG.split("total time")[0])


def test_without_llama_cpp_the_script_skips_and_says_how_to_point_at_it(script, tmp_path, monkeypatch, capsys):
    monkeypatch.delenv("LLAMA_CPP_BIN", raising=False)
    monkeypatch.setenv("PATH", str(tmp_path))
    assert script.main([]) == 0
    assert "skipped: llama-diffusion-cli is not on PATH" in capsys.readouterr().out
    assert script.main(["--llama-cpp-bin", str(tmp_path)]) == 0
    assert f"skipped: {tmp_path / 'llama-diffusion-cli'} does not exist" in capsys.readouterr().out


def test_a_converter_interpreter_without_its_requirements_skips(script, tmp_path):
    (tmp_path / "convert_hf_to_gguf.py").write_text("")
    with pytest.raises(script.Skip, match="cannot run llama.cpp's converter"):
        script.find_converter(str(tmp_path), tmp_path / "llama-diffusion-cli", "false")
    with pytest.raises(script.Skip, match="no convert_hf_to_gguf.py"):
        script.find_converter(str(tmp_path / "elsewhere"), tmp_path / "llama-diffusion-cli", "true")


def test_a_llama_case_runs_the_cli_and_times_it_by_its_own_total(script, tmp_path):
    fake = tmp_path / "llama-diffusion-cli"
    (tmp_path / "log").write_text(LOG)
    fake.write_text(f'#!/bin/sh\necho "$@" > {tmp_path / "args"}\ncat {tmp_path / "log"} >&2\n')
    fake.chmod(fake.stat().st_mode | stat.S_IEXEC)
    texts = {}
    command = script.cli_command(fake, tmp_path / "model.gguf", "a prompt", threads=2)
    metrics = script.llama_case("llama.cpp F32", command, texts).run()
    assert metrics.latency_s == pytest.approx(2.28766) and metrics.forwards_executed == 4
    assert metrics.tokens_per_s == pytest.approx(script.GEN_LENGTH / 2.28766)
    assert texts == {"llama.cpp F32": "hello out there"}
    args = (tmp_path / "args").read_text().split()
    canvas = str(script.PROMPT_TOKENS + script.GEN_LENGTH)
    assert args[args.index("-ub") + 1] == canvas and args[args.index("--diffusion-steps") + 1] == canvas
    assert args[args.index("--diffusion-block-length") + 1] == str(script.BLOCK_LENGTH)
    assert args[args.index("-t") + 1] == "2" and args[args.index("--temp") + 1] == "0"


def test_the_checkpoint_holds_the_tokenizer_and_special_ids_both_tools_read(script, tmp_path):
    import json

    import dlmrt

    directory = script.write_checkpoint(tmp_path / "checkpoint")
    config = json.loads((directory / "config.json").read_text())
    assert config["rms_norm_eps"] == script.LLADA_RMS_NORM_EPS
    model = dlmrt.load(directory)
    vocab = config["vocab_size"]
    assert model.tokenizer.token_to_id(script.EOS_TOKEN) == vocab - 2 == model.tokens.eos_ids[0]
    assert model.tokenizer.token_to_id(script.MASK_TOKEN) == vocab - 1 == model.tokens.mask_id
    assert json.loads(model.tokenizer_config)["chat_template"] == script.PLAIN_CHAT_TEMPLATE
    prompt = script.prompt_text(model.tokenizer, 31)
    assert len(model.tokenizer.encode(prompt).ids) == 31
    assert os.path.getsize(directory / "model.safetensors") > 4 * 20_000_000  # llada-512x6's float32 weights
