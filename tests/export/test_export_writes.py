"""An export never loses what a user made: it replaces only a dlmrt export, never a file or another
directory; a kill at any point leaves the previous export loadable; and its leftovers are cleaned."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

pytest.importorskip("onnxruntime")

from dlmrt.core import atomic  # noqa: E402
from dlmrt.core.errors import ArgumentError  # noqa: E402
from dlmrt.export import onnx_export  # noqa: E402
from dlmrt.models import checkpoint
from dlmrt.export.export_manifest import ExportManifest  # noqa: E402
from helpers import LLADA, random_model  # noqa: E402

LIMITS = {"max_batch": 2, "max_length": 16}


@pytest.fixture(scope="module")
def model():
    return random_model(LLADA)


def test_an_export_onto_a_directory_it_did_not_write_is_refused(model, tmp_path):
    out = tmp_path / "mine"
    out.mkdir()
    (out / "notes.txt").write_text("my notes")
    with pytest.raises(ArgumentError, match="exists and is not a dlmrt export: dlmrt replaces only what it wrote"):
        onnx_export.export(model, out, **LIMITS)
    assert [p.name for p in out.iterdir()] == ["notes.txt"] and (out / "notes.txt").read_text() == "my notes"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["mine"]  # no staging left behind


def test_an_export_onto_a_file_is_refused(model, tmp_path):
    target = tmp_path / "model.onnx"
    target.write_bytes(b"mine")
    with pytest.raises(ArgumentError, match="is a file, and a dlmrt export is a directory"):
        onnx_export.export(model, target, **LIMITS)
    assert target.read_bytes() == b"mine" and sorted(p.name for p in tmp_path.iterdir()) == ["model.onnx"]


@pytest.fixture
def traced_once(monkeypatch):
    """The writes are what is tested: each graph is traced once per test, not once per export."""
    traced, trace = {}, onnx_export.export_graph
    monkeypatch.setattr(onnx_export, "export_graph", lambda model, graph, *args: traced.get(graph) or
                        traced.setdefault(graph, trace(model, graph, *args)))


def test_a_re_export_swaps_in_one_step_and_cleans_the_leftovers_of_dead_writers(model, tmp_path, traced_once):
    out = tmp_path / "out"
    onnx_export.export(model, out, **LIMITS)
    dead = tmp_path / ".out.999999999.abc.partial"  # a pid no process has
    live = tmp_path / f".out.{os.getpid()}.abc.partial"  # a writer still running
    for leftover in (dead, live):
        leftover.mkdir()
    onnx_export.export(model, out, **LIMITS)
    ExportManifest.load(out)
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(["out", live.name])


def test_the_exchange_swaps_two_directories(tmp_path):
    first, second = tmp_path / "a", tmp_path / "b"
    first.mkdir()
    second.mkdir()
    (first / "x").write_text("a")
    (second / "x").write_text("b")
    if not atomic.exchange(first, second):
        pytest.skip("this system has no renameat2 RENAME_EXCHANGE (the two-rename fallback runs)")
    assert (first / "x").read_text() == "b" and (second / "x").read_text() == "a"


# Run in one process that imports once, traces the graphs once and forks each export, so that a kill
# point costs the writes alone: the writer is killed `point` seconds into its run, then the export
# directory is loaded. A kill while tracing has nothing on disk to damage; the writes, the fsyncs and
# the swap are where an export can be half-done, and the points cover them densely.
KILLER = """
import json, os, random, signal, sys, time
import dlmrt
from dlmrt.export import onnx_export
from dlmrt.export.export_manifest import ExportManifest

model_dir, out, limits = sys.argv[1], sys.argv[2], json.loads(sys.argv[3])
model = dlmrt.load(model_dir)
traced, trace = {}, onnx_export.export_graph
onnx_export.export_graph = lambda model, graph, *args: traced.get(graph) or traced.setdefault(
    graph, trace(model, graph, *args))
onnx_export.export(model, out, **limits)  # the previous export, and the graphs every writer reuses

def run(point=None):
    started = time.monotonic()
    pid = os.fork()
    if pid == 0:
        onnx_export.export(model, out, **limits)
        os._exit(0)
    if point is not None:
        time.sleep(point)
        os.kill(pid, signal.SIGKILL)
    os.waitpid(pid, 0)
    return time.monotonic() - started

duration = run()
chance = random.Random(0)
points = [chance.uniform(0, duration) for _ in range(8)] + \\
         [chance.uniform(0.85 * duration, 1.05 * duration) for _ in range(8)]
for point in points:
    run(point)
    ExportManifest.load(out)  # the previous export or the new one, every file matching its sha256
run()  # the next write removes what the killed writers left
print(json.dumps({"duration": duration, "points": points, "after": sorted(os.listdir(os.path.dirname(out)))}))
"""


def test_an_export_killed_at_16_random_points_leaves_the_previous_export_loadable(model, tmp_path):
    """Eight kill points spread over a re-export's writes, eight over their last 15% and just past it,
    where the files are fsynced and swapped in. Each kill is followed by a full load of the export."""
    import json

    model_dir = checkpoint.save(model, tmp_path / "model")
    out = tmp_path / "exports" / "out"
    out.parent.mkdir()
    done = subprocess.run([sys.executable, "-c", KILLER, str(model_dir), str(out), json.dumps(LIMITS)],
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads(done.stdout.splitlines()[-1])
    assert len(report["points"]) == 16 and any(p > report["duration"] * 0.9 for p in report["points"])
    assert report["after"] == ["out"]
