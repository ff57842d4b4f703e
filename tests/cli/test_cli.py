"""`dlmrt generate`: outputs, JSON metrics, and one-line errors for bad input."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from click.testing import CliRunner

from dlmrt.cli.commands import main
from dlmrt.models import checkpoint
from dlmrt.runtime.policy_registry import POLICIES
from helpers import LLADA, LLADA2, random_model


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    model = random_model(LLADA)
    model.generation_config = {"gen_length": 8, "block_length": 4}
    return checkpoint.save(model, tmp_path_factory.mktemp("cli") / "model")


def run(*args):
    return CliRunner().invoke(main, [str(a) for a in args])


def test_help_lists_the_llada_options():
    result = run("generate", "--help")
    assert result.exit_code == 0
    for option in ("--gen-length", "--block-length", "--steps", "--remasking", "--temperature",
                   "--cfg-scale", "--seed", "--dtype", "--prompt-ids", "--json", "--policy", "--threshold",
                   "--factor", "--confidence", "--cache", "--stream", "--ignore-eos", "--backend"):
        assert option in result.output


def test_the_policy_help_lists_the_registered_policies():
    """Every registered policy, in the registry's order, and no other name: the help is the registry's."""
    result = run("generate", "--help")
    assert result.exit_code == 0
    listed = re.search(r"Decoding policy: (.*?) \[default:", " ".join(result.output.split())).group(1)
    assert [item.partition(" (")[0] for item in listed.split("; ")] == list(POLICIES)
    assert "dream" in POLICIES


@pytest.mark.parametrize("args", [["--help"], ["generate", "--help"]])
def test_help_does_not_import_torch(args):
    code = ("import sys; from dlmrt.cli.commands import main; main(sys.argv[1:], standalone_mode=False); "
            "print(sorted(name for name in ('torch', 'numpy', 'dlmrt.runtime.policies') if name in sys.modules))")
    result = subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    assert result.stdout.splitlines()[-1] == "[]"


def test_json_output_and_metrics(model_dir):
    result = run("generate", "--model", model_dir, "--prompt-ids", "5,6,7", "--prompt-ids", "8,9",
                 "--gen-length", 8, "--block-length", 4, "--steps", 4, "--json", "--mode", "eager")
    assert result.exit_code == 0, result.output
    payload = json.loads(result.output)
    assert len(payload["outputs"]) == 2
    for output in payload["outputs"]:
        assert len(output["token_ids"]) <= 8 and 1 not in output["token_ids"]  # cut at the first EOS
        assert output["finish_reason"] in ("eos", "length")
        assert isinstance(output["text"], str)
    metrics = payload["metrics"]
    assert metrics["nfe"] == 4 and metrics["generated_tokens"] == 16 and metrics["batch_size"] == 2
    assert metrics["tpf"] == 2.0 and metrics["tokens_per_s"] > 0 and metrics["prompt_tokens"] == 5


def test_defaults_come_from_generation_config(model_dir):
    result = run("generate", "--model", model_dir, "--prompt", "rev:abc=", "--json", "--mode", "eager")
    assert result.exit_code == 0, result.output
    assert json.loads(result.output)["metrics"]["nfe"] == 8  # gen_length 8, one token per step


def test_text_output_is_one_line_per_prompt(model_dir):
    result = run("generate", "--model", model_dir, "--prompt", "rev:abc=", "--prompt", "sort:321=", "--mode", "eager")
    assert result.exit_code == 0, result.output
    assert len(result.output.splitlines()) == 2


@pytest.mark.parametrize("args, message", [
    (["--prompt-ids", "1,x"], "expected comma-separated token ids"),
    (["--prompt-ids", "1 3,1 6"], "expected comma-separated token ids like 1,2,3, got '1 3,1 6'"),  # not [13, 16]
    (["--prompt-ids", "1_3"], "expected comma-separated token ids"),
    (["--prompt-ids", "5,"], "expected comma-separated token ids"),
    (["--prompt-ids", "5,999"], "prompt 0 has token ids outside the vocabulary [0, 43): [999]"),
    (["--prompt-ids", "5", "--gen-length", "10", "--block-length", "4"],
     "gen-length (10) must be divisible by block-length (4)"),
    (["--prompt-ids", "5", "--gen-length", "8", "--block-length", "4", "--steps", "3"],
     "steps (3) must be divisible by the number of blocks"),
    (["--prompt-ids", "5", "--gen-length", "0"], "Invalid value for '--gen-length': 0 is not in the range 1<=x<="),
    (["--prompt-ids", "5", "--steps", "0"], "Invalid value for '--steps': 0 is not in the range 1<=x<="),
    (["--prompt", "rev:ABC="], "characters not in its vocabulary: ['A', 'B', 'C']"),
    (["--prompt", "x", "--prompt-ids", "1"], "give either --prompt or --prompt-ids, not both"),
    (["--prompt-ids", "5", "--policy", "greedy"], "unknown policy 'greedy'"),
    (["--prompt-ids", "5", "--policy", "factr"], "did you mean 'factor'?"),
    (["--prompt-ids", "5", "--policy", "threshold", "--threshold", "1.5"], "threshold must lie in (0, 1], got 1.5"),
    (["--prompt-ids", "5", "--policy", "residual"], "policy 'residual' needs an ORL model"),
    (["--prompt-ids", "5", "--block-length", "0"], "'--block-length': 0 is not in the range 1<=x<="),
    (["--prompt-ids", "5", "--max-block-steps", "0"], "'--max-block-steps': 0 is not in the range 1<=x<="),
    ([], "give at least one --prompt or --prompt-ids"),
    (["--prompt-ids", "5", "--policy", "factor", "--factor", "1e308"], "must fit in float32 (at most 3.4e+38"),
    (["--prompt-ids", "5", "--temperature", "1e308"], "must fit in float32"),
    (["--prompt-ids", "5", "--temperature", "inf"], "must be a finite number, got inf"),
    (["--prompt-ids", "5", "--temperature", "nan"], "must be a finite number, got nan"),
    (["--prompt-ids", "5", "--cfg-scale", "inf"], "must be a finite number, got inf"),
    (["--prompt-ids", "5", "--seed", str(2**63)], "is not in the range 0<=x<=4611686018427387904"),
    (["--prompt-ids", "5", "--seed", "-1"], "is not in the range 0<=x<="),
    (["--prompt-ids", "5", "--steps", "1000000000"], "'--steps': 1000000000 is not in the range 1<=x<=16777216"),
    (["--prompt", "rev:ab\udcffc="], "--prompt is not valid UTF-8 (character 7 is an undecodable byte)"),
])
def test_bad_input_gives_one_clear_line(model_dir, args, message):
    result = run("generate", "--model", model_dir, *args)
    assert result.exit_code == 2
    assert message in result.output
    assert "Traceback" not in result.output


def test_missing_model_directory():
    result = run("generate", "--model", "/nonexistent/model", "--prompt-ids", "5,6")
    assert result.exit_code == 2
    assert result.output.strip() == "Error: model directory /nonexistent/model does not exist"


def test_stream_prints_what_generate_prints(model_dir):
    args = ("--model", model_dir, "--prompt", "rev:abc=", "--policy", "threshold", "--threshold", "0.3")
    streamed, plain = run("generate", *args, "--stream", "--mode", "eager"), run("generate", *args, "--mode", "eager")
    assert streamed.exit_code == 0 and plain.exit_code == 0, streamed.output + plain.output
    assert streamed.output == plain.output


def test_backends_agree_and_caches_count_their_refreshes(model_dir):
    args = ("--model", model_dir, "--prompt-ids", "5,6,7", "--gen-length", 8, "--block-length", 4, "--steps", 8,
            "--ignore-eos", "--json")
    torch_out = json.loads(run("generate", *args, "--cache", "dual", "--mode", "eager").output)
    reference_out = json.loads(run("generate", *args, "--backend", "reference").output)
    assert torch_out["metrics"]["nfe"] == reference_out["metrics"]["nfe"] == 8  # refreshes are forwards
    none_out = json.loads(run("generate", *args, "--mode", "eager").output)
    assert none_out["outputs"] == reference_out["outputs"]


def test_dual_cache_on_a_block_causal_model_is_one_line(tmp_path):
    directory = checkpoint.save(random_model(LLADA2), tmp_path / "llada2")
    result = run("generate", "--model", directory, "--prompt-ids", "5,6", "--cache", "dual")
    assert result.exit_code == 2 and "Traceback" not in result.output
    assert "cache mode 'dual' does not apply to llada2: it is block-causal" in result.output


def test_the_onnx_path_names_its_extra_when_missing(model_dir, monkeypatch):
    import importlib.util

    find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "onnxruntime"
                        else find_spec(name, *a))
    for args in (["generate", "--model", model_dir, "--prompt-ids", "5", "--backend", "ort"],
                 ["export", model_dir, "-o", "unused"]):
        result = run(*args)
        assert result.exit_code == 2 and "Traceback" not in result.output
        assert "the ONNX path needs onnxruntime: pip install 'dlmrt[onnx]'" in result.output


def test_an_internal_error_is_one_line_asking_for_a_report(monkeypatch, capsys):
    """The installed command's guard of last resort; the tests' CliRunner calls bypass it."""
    from dlmrt import cli

    def broken(*args, **kwargs):
        raise KeyError("deep inside")

    monkeypatch.setattr("dlmrt.runtime.settings.settings_with_defaults", broken)
    monkeypatch.delenv("DLMRT_DEBUG", raising=False)
    argv = ["generate", "--prompt-ids", "5", "--backend", "reference"]
    monkeypatch.setattr("sys.argv", ["dlmrt", *argv])
    with pytest.raises(SystemExit) as exit_:
        cli.run()
    err = capsys.readouterr().err
    assert exit_.value.code == 70 and "Traceback" not in err and len(err.strip().splitlines()) == 1
    assert err.startswith("dlmrt generate: internal error (KeyError: 'deep inside'). This is a bug in dlmrt")
    for debug in (["--debug"], []):
        monkeypatch.setattr("sys.argv", ["dlmrt", *debug, *argv])
        if not debug:
            monkeypatch.setenv("DLMRT_DEBUG", "1")
        with pytest.raises(KeyError, match="deep inside"):
            cli.run()
    assert isinstance(run(*argv).exception, KeyError)  # what the tests see


@pytest.mark.parametrize("command", [["generate", "--prompt-ids", "5"], ["eval"], ["serve"]])
@pytest.mark.parametrize("backend", ["torch", "ort"])
def test_a_model_directory_that_does_not_exist_is_one_line(tmp_path, command, backend):
    missing = tmp_path / "no-such-dir"
    result = run(*command, "--backend", backend, "--model", missing)
    assert result.exit_code == 2, result.output
    assert f"model directory {missing} does not exist" in result.output and "Traceback" not in result.output


def test_serve_without_the_serve_extra_names_the_extra(monkeypatch):
    monkeypatch.setitem(sys.modules, "uvicorn", None)  # neither found nor importable, as on a base install
    result = run("serve")
    assert result.exit_code == 2, result.output
    assert "dlmrt serve needs uvicorn: pip install 'dlmrt[serve]'" in result.output


def test_ctrl_c_exits_130_with_one_line(monkeypatch, capsys):
    from dlmrt import cli

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr("dlmrt.runtime.settings.settings_with_defaults", interrupted)
    monkeypatch.setattr("sys.argv", ["dlmrt", "generate", "--prompt-ids", "5", "--backend", "reference"])
    with pytest.raises(SystemExit) as exit_:
        cli.run()
    err = capsys.readouterr().err
    assert exit_.value.code == 130 and "Traceback" not in err and err.strip() == "Aborted!"


def test_the_command_keeps_compiled_steps_under_dlmrt_home(model_dir, tmp_path):
    """What a later process's compile finds: inductor's graph and autograd caches in $DLMRT_HOME/inductor."""
    env = {**os.environ, "DLMRT_HOME": str(tmp_path / "home")}
    env.pop("TORCHINDUCTOR_CACHE_DIR")  # the tests' own, which the command would otherwise inherit
    result = subprocess.run([sys.executable, "-m", "dlmrt.cli", "generate", "--model", str(model_dir), "--prompt-ids",
                             "5,6", "--gen-length", "4", "--block-length", "4", "--mode", "compile"],
                            env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    cache = tmp_path / "home" / "inductor"
    assert any((cache / "fxgraph").iterdir()) and any((cache / "aotautograd").iterdir())


def test_the_model_may_come_as_an_argument(model_dir):
    """`dlmrt generate MODEL` (vLLM's habit) is `dlmrt generate --model MODEL`."""
    args = ("--prompt", "rev:abc=", "--json", "--mode", "eager")
    positional, named = run("generate", model_dir, *args), run("generate", "--model", model_dir, *args)
    assert positional.exit_code == 0, positional.output
    assert json.loads(positional.output)["outputs"] == json.loads(named.output)["outputs"]
    assert json.loads(positional.output)["metrics"]["nfe"] == 8  # model_dir's own generation_config, not the tiny's


@pytest.mark.parametrize("command", [["generate", "--prompt-ids", "5"], ["eval"], ["bench"], ["serve"]])
def test_a_model_given_twice_differently_is_one_usage_line(tmp_path, command):
    result = run(*command, tmp_path / "a", "--model", tmp_path / "b")
    assert result.exit_code == 2, result.output
    assert re.search(rf"give the model once: (MODEL|DIR\|NAME) {tmp_path / 'a'} or --model {tmp_path / 'b'}, not both",
                     result.output), result.output


def test_a_suite_refuses_a_model_argument_as_it_refuses_the_option():
    suite = Path(__file__).parents[2] / "benchmarks" / "ci.toml"
    result = run("bench", "llada-512x6", "--suite", suite)
    assert result.exit_code == 2, result.output
    assert "--suite sets every scenario's options: drop --model, or set it in the suite" in result.output


@pytest.mark.parametrize("gen_length, warned", [(["--gen-length", "32"], True), (["--gen-length", "16"], False),
                                                ([], False)])
def test_the_tiny_model_warns_once_off_its_trained_length(capsys, gen_length, warned):
    """The tiny model answers nonsense at any length but the one it was trained for: one line says so."""
    from dlmrt.cli.errors import guarded

    status = guarded(main, ["generate", "--prompt", "add:762+139=", "--prompt", "rev:hello=", "--mode", "eager",
                            *gen_length])
    err = capsys.readouterr().err
    assert status == 0, err
    warnings = [line for line in err.splitlines() if "was trained to generate" in line]
    expected = ["Warning: tiny-llada was trained to generate exactly 16 tokens: at gen-length 32 it answers "
                "nonsense. Use --gen-length 16 (or leave it out)"]
    assert warnings == (expected if warned else [])


@pytest.mark.parametrize("argv, advice", [
    (["serve"], "pip install 'dlmrt[serve]'"),  # uvicorn hidden below
    (["generate", "--backend", "ort", "--model", "/no/such/dir", "--prompt", "x"], "/no/such/dir does not exist"),
    (["eval", "--backend", "ort", "--model", "/no/such/dir"], "/no/such/dir does not exist"),
    (["serve", "--backend", "ort", "--model", "/no/such/dir"], "/no/such/dir does not exist"),
    (["serve", "/no/such/dir"], "/no/such/dir does not exist"),  # the model as vLLM's `serve MODEL` takes it
    (["generate", "--prompt", "x", "--policy", "treshold"], "did you mean 'threshold'?"),
    (["generate", "/no/a", "--model", "/no/b", "--prompt", "x"], "give the model once"),
    (["generate", "--prompt", "rev:ABC="], "characters not in its vocabulary"),
    (["bench", "--backend", "tensorrt"],
     "give torch[:eager|compile|cudagraph|auto][:fp8], ort[:int8|int4|int8-dynamic] or reference"),
])
def test_an_ordinary_mistake_is_one_line_that_says_what_to_do(monkeypatch, capsys, argv, advice):
    """Through the installed command's guard: exit status 2, one 'Error:' line with the advice, and never
    'a bug in dlmrt'."""
    from dlmrt.cli.errors import guarded

    if argv == ["serve"]:
        monkeypatch.setitem(sys.modules, "uvicorn", None)
    status = guarded(main, argv)
    err = capsys.readouterr().err
    errors = [line for line in err.splitlines() if line.startswith("Error:")]
    assert status == 2 and len(errors) == 1 and advice in errors[0], err
    assert "bug in dlmrt" not in err and "Traceback" not in err
