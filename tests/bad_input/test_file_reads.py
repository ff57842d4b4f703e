"""Every file dlmrt is given is read by dlmrt.core.file_reads: a device, a FIFO or a directory is refused
before it is opened, and a file over the bound of its kind before it is read, each in one line that names
the file. The bounds are patched small here: nothing large is written."""

from __future__ import annotations

import contextlib
import os
import shutil
import stat
import threading
from pathlib import Path

import pytest
from click.testing import CliRunner

import dlmrt
from dlmrt.cli.commands import main
from dlmrt.core import file_reads, limits
from dlmrt.core.errors import ArgumentError, CheckpointError
from dlmrt.quant.calibration import CalibrationError, load_prompts
from dlmrt.eval.evaluation import load_jsonl

EXAMPLE = '{"prompt": "add:1+2=", "answer": "3"}\n'
SPECIAL = "only from a regular file (save it to one, and give that)"


@contextlib.contextmanager
def fifo_at(path: Path):
    """A named pipe at `path`. A writer waits at its other end, so that code that opens it for reading gets
    an empty file (and fails the test's assertion) instead of waiting forever."""
    os.mkfifo(path)
    writer = threading.Thread(target=lambda: open(path, "wb").close(), daemon=True)
    writer.start()
    try:
        yield path
    finally:
        reader = os.open(path, os.O_RDONLY | os.O_NONBLOCK)  # lets the writer go, had nobody opened the pipe
        writer.join(timeout=60)
        os.close(reader)


@pytest.fixture
def model_dir(tmp_path):
    return Path(shutil.copytree(dlmrt.TINY_MODEL_DIR, tmp_path / "model"))


def one_error_line(result) -> str:
    assert result.exit_code == 2, result.output
    assert "Traceback" not in result.output
    (line,) = result.output.strip().splitlines()
    return line


@pytest.mark.skipif(not os.path.exists("/dev/zero"), reason="needs /dev/zero")
def test_eval_data_from_dev_zero_is_one_line_at_once():
    """It was read to a MemoryError, after 35 s, reported as a bug in dlmrt."""
    line = one_error_line(CliRunner().invoke(main, ["eval", "--data", "/dev/zero"]))
    assert line == f"Error: /dev/zero is a character device: dlmrt reads eval data {SPECIAL}"


def test_eval_data_over_its_bound(tmp_path, monkeypatch):
    data = tmp_path / "examples.jsonl"
    data.write_text(EXAMPLE * 5)
    assert len(load_jsonl(data)) == 5
    monkeypatch.setattr(limits, "MAX_DATA_BYTES", 100)
    line = one_error_line(CliRunner().invoke(main, ["eval", "--data", str(data)]))
    assert line == (f"Error: {data} is {data.stat().st_size} bytes, more than dlmrt reads as eval data (at most "
                    f"100 bytes): split it, and evaluate the parts in turn")


def test_a_fifo_as_the_calibration_prompts_file(tmp_path):
    with fifo_at(tmp_path / "prompts.txt") as path, pytest.raises(CalibrationError) as error:
        load_prompts(path)
    assert str(error.value) == f"{path} is a named pipe (FIFO): dlmrt reads calibration prompts {SPECIAL}"


@pytest.mark.parametrize("name, what", [("config.json", "JSON"), ("tokenizer.json", "a tokenizer"),
                                        ("generation_config.json", "JSON"), ("model.safetensors", "weights")])
def test_a_fifo_in_a_model_directory(model_dir, name, what):
    """A FIFO config.json was "no config.json", and a FIFO tokenizer.json was skipped: the model loaded
    without its tokenizer."""
    (model_dir / name).unlink()
    with fifo_at(model_dir / name) as path, pytest.raises(CheckpointError) as error:
        dlmrt.load(model_dir)
    assert str(error.value) == f"{path} is a named pipe (FIFO): dlmrt reads {what} {SPECIAL}"


def test_a_fifo_as_the_bench_suite(tmp_path):
    with fifo_at(tmp_path / "suite.toml") as path:
        line = one_error_line(CliRunner().invoke(main, ["bench", "--suite", str(path)]))
    assert line == f"Error: {path} is a named pipe (FIFO): dlmrt reads a bench suite {SPECIAL}"


@pytest.mark.parametrize("bound, name, what, to_do", [
    ("MAX_DATA_BYTES", "tokenizer.json", "a tokenizer", "check that it is the model's tokenizer.json"),
    ("MAX_CONFIG_BYTES", "config.json", "JSON", "check that it is the right file"),
    ("MAX_WEIGHTS_BYTES", "model.safetensors", "weights", "shard the checkpoint (model.safetensors.index.json)"),
])
def test_a_model_file_over_its_bound(model_dir, monkeypatch, bound, name, what, to_do):
    path = model_dir / name
    found = path.stat().st_size
    monkeypatch.setattr(limits, bound, found - 1)
    with pytest.raises(CheckpointError) as error:
        dlmrt.load(model_dir)
    assert str(error.value) == (f"{path} is {limits.size(found)}, more than dlmrt reads as {what} (at most "
                                f"{limits.size(found - 1)}): {to_do}")
    monkeypatch.setattr(limits, bound, found)
    assert dlmrt.load(model_dir).name == "model"


def test_a_directory_is_no_file(tmp_path):
    with pytest.raises(ArgumentError) as error:
        load_jsonl(tmp_path)
    assert str(error.value) == f"{tmp_path} is a directory: dlmrt reads eval data {SPECIAL}"


@pytest.mark.skipif(not os.path.exists("/proc/self/status"), reason="needs Linux's /proc")
def test_a_file_longer_than_its_size_says_is_bounded_by_what_is_read():
    """/proc files say they hold 0 bytes: the read itself stops at the bound and one byte."""
    assert os.stat("/proc/self/status").st_size == 0
    with pytest.raises(ArgumentError) as error:
        file_reads.read_bytes("/proc/self/status", ArgumentError, most=64, what="eval data")
    assert str(error.value) == ("/proc/self/status holds more than dlmrt reads as eval data (at most 64 bytes): "
                                "check that it is the right file")
    assert len(file_reads.read_bytes("/proc/self/status", ArgumentError, most=1 << 20, what="eval data")) > 64


def test_the_opened_file_is_checked_again(tmp_path, monkeypatch):
    """A path that was a regular file at its stat and is a FIFO when opened: the open does not wait for a
    writer (O_NONBLOCK), and the descriptor's own stat refuses it."""
    regular = tmp_path / "examples.jsonl"
    regular.write_text(EXAMPLE)
    os.mkfifo(tmp_path / "pipe")
    real_stat = os.stat
    monkeypatch.setattr(file_reads.os, "stat", lambda path, *args, **kwargs: real_stat(regular))
    with pytest.raises(ArgumentError) as error:
        file_reads.read_text(tmp_path / "pipe", ArgumentError, most=1 << 20, what="eval data")
    monkeypatch.undo()
    assert stat.S_ISFIFO(os.stat(tmp_path / "pipe").st_mode)
    assert str(error.value) == f"{tmp_path / 'pipe'} is a named pipe (FIFO): dlmrt reads eval data {SPECIAL}"
