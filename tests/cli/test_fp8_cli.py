"""`--precision fp8` on the torch backend and the bench cases `torch[:MODE]:fp8`: they parse, they run on a
CPU, and bad values give one clear line."""

from __future__ import annotations

import json

import click
import pytest
from click.testing import CliRunner

from dlmrt.bench.backend_specs import split_case, torch_case
from dlmrt.cli.bench import parse_backends
from dlmrt.cli.commands import main


def invoke(*args):
    return CliRunner().invoke(main, [*map(str, args)])


@pytest.mark.parametrize("spec, expected", [
    ("torch", [("torch", "auto")]),
    ("torch:eager", [("torch", "eager")]),
    ("torch:fp8", [("torch", "auto:fp8")]),
    ("torch:cudagraph:fp8,torch:cudagraph", [("torch", "cudagraph:fp8"), ("torch", "cudagraph")]),
    ("torch:compile:fp8,ort", [("torch", "compile:fp8"), ("ort", None)]),
])
def test_torch_specs_with_and_without_fp8_parse(spec, expected):
    assert parse_backends(spec) == expected


@pytest.mark.parametrize("spec", ["torch:fp8:eager", "torch:fp16", "torch:eager:eager", "torch:eager:fp8:fp8",
                                  "ort:fp8"])
def test_bad_torch_specs_are_refused_in_one_line(spec):
    with pytest.raises(click.BadParameter, match="unknown backend") as raised:
        parse_backends(spec)
    assert "torch[:eager|compile|cudagraph|auto][:fp8]" in str(raised.value)


def test_the_same_case_twice_is_refused():
    with pytest.raises(click.BadParameter, match="twice"):
        parse_backends("torch:fp8,torch:auto:fp8")


def test_split_case():
    assert split_case(torch_case("cudagraph:fp8")) == ("cudagraph", "fp8")
    assert split_case(torch_case("")) == ("auto", None)


def test_generate_in_fp8_on_a_cpu():
    result = invoke("generate", "--precision", "fp8", "--mode", "eager", "--prompt", "add:762+139=")
    assert result.exit_code == 0, result.output
    assert result.output.splitlines()[0] == "0901"


@pytest.mark.parametrize("arguments, message", [
    (["--precision", "bf16"], "--precision bf16 with --backend torch: torch runs fp8"),
    (["--precision", "fp8", "--tp", "2"], "--precision fp8 runs the model on one device"),
])
def test_generate_refuses_what_fp8_cannot_run(arguments, message):
    result = invoke("generate", "--prompt", "add:1+2=", *arguments)
    assert result.exit_code == 2 and message in result.output, result.output
    assert "Traceback" not in result.output


def test_bench_runs_an_fp8_case_beside_the_float_one(tmp_path):
    out = tmp_path / "bench.json"
    result = invoke("bench", "--backend", "torch:eager,torch:eager:fp8", "--input-len", 8, "--output-len", 16,
                    "--block-length", 8, "--num-iters", 1, "--num-iters-warmup", 0, "--output-json", out)
    assert result.exit_code == 0, result.output
    cases = json.loads(out.read_text())["scenarios"]["bench"]["cases"]
    assert [case["setting"] for case in cases] == ["torch:eager", "torch:eager:fp8"]
    assert all(case["nfe"] > 0 for case in cases)


def test_the_gate_counts_an_fp8_case_with_no_more_host_reads_and_the_same_flops():
    import dlmrt
    from dlmrt.bench.counted import count_work
    from dlmrt.runtime import GenerationSettings, Threshold

    model = dlmrt.load()
    prompts = [model.tokenizer.encode(p).ids for p in ("add:762+139=", "rev:hello=")]
    settings = GenerationSettings(gen_length=16, block_length=8, policy=Threshold(0.9), cache="dual")
    floats, fp8 = (count_work(kind, model, prompts, settings) for kind in ("torch:eager", "torch:eager:fp8"))
    assert fp8.nfe > 0 and fp8.host_reads / fp8.nfe <= floats.host_reads / floats.nfe
    assert fp8.flops_per_token == floats.flops_per_token  # _scaled_mm counts the float product's 2*M*K*N
    assert fp8.aten_ops_per_step > floats.aten_ops_per_step  # and the activations' quantization
