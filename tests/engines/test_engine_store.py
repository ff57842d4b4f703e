"""The engine store, manifests, engine selection and `dlmrt build` / `dlmrt inspect` on the CPU.

TensorRT cannot run here, so the builds below hand `build.run` a stand-in for `builder.build_graph`
that returns bytes derived from the graph it is given: everything around TensorRT (plans, quantized
inputs, preflight, atomic store writes, manifests, selection) is the real code. The TensorRT builder
itself is tested by the `trt` tests at the end, where TensorRT is installed.
"""

from __future__ import annotations

import hashlib
import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
from click.testing import CliRunner

from dlmrt.cli.commands import main
from dlmrt.engines import build, builder, manifest, targets
from dlmrt.engines.plan import make_plan
from dlmrt.engines.select import EngineMismatch, select
from dlmrt.engines.store import EngineStore, StoreError
from dlmrt.export.export_manifest import ExportManifest

TENSORRT = "10.13.0.35"
CAPABILITY = (9, 0)


class StandInBuilder:
    """Returns an 'engine' that names the graph and the sha256 of the ONNX it was given, and records
    the timing cache each call received."""

    def __init__(self, tag: bytes = b"v1"):
        self.tag = tag
        self.caches = []

    def __call__(self, plan, graph, onnx_path, timing_cache):
        self.caches.append(timing_cache)
        digest = hashlib.sha256(Path(onnx_path).read_bytes()).hexdigest()
        cache = (timing_cache or b"") + f"[{graph.name}]".encode()
        return self.tag + f":{graph.name}:{digest}".encode(), cache


def make(export_dir, store, precision="bf16", **options):
    return make_plan(export_dir, targets.target_named("sm_90"), precision, tensorrt=TENSORRT, store=store.root,
                     **options)


def run_build(export_dir, store, engine_builder, **options):
    return build.run(make(export_dir, store, **options), store, device="NVIDIA H200", tensorrt_version=TENSORRT,
                     engine_builder=engine_builder)


def test_a_build_writes_engines_timing_cache_and_a_manifest_that_inspect_checks(tiny_export, tmp_path):
    store = EngineStore(tmp_path / "engines")
    entry = run_build(tiny_export, store, StandInBuilder())
    assert entry == tmp_path / "engines" / "tiny-llada" / "sm_90-bf16"
    assert sorted(p.relative_to(entry).as_posix() for p in entry.rglob("*") if p.is_file()) == [
        "cached/engine.plan", "full/engine.plan", "manifest.json", "timing.cache"]
    record = manifest.read(entry)
    export = ExportManifest.read(tiny_export)
    assert record["graphs"]["full"]["onnx_sha256"] == export.graph_sha256("full")
    assert record["graphs"]["full"]["built_from_sha256"] == export.graph_sha256("full")
    assert (record["compute_capability"], record["tensorrt_version"], record["precision"]) == (
        "9.0", TENSORRT, "bf16")
    assert record["plugins"] == [{"name": "ParallelUnmask", "namespace": "dlmrt", "version": "2"}]
    assert manifest.problems(entry, record) == []
    (entry / "full" / "engine.plan").write_bytes(b"tampered")
    assert manifest.problems(entry, record) == [
        f"full/engine.plan has sha256 {hashlib.sha256(b'tampered').hexdigest()[:16]}…, the manifest says "
        f"{record['graphs']['full']['engine_sha256'][:16]}…"]


def test_a_rebuild_replaces_the_entry_whole_and_reuses_the_timing_cache(tiny_export, tmp_path):
    store = EngineStore(tmp_path / "engines")
    entry = run_build(tiny_export, store, StandInBuilder(b"v1"))
    first_version = entry.resolve()
    second = StandInBuilder(b"v2")
    run_build(tiny_export, store, second)
    assert second.caches[0] == b"[full][cached]"  # the first build's cache, then the one it grew
    assert (entry / "full" / "engine.plan").read_bytes().startswith(b"v2:")
    assert not first_version.exists()  # the old version is gone once the new one is in place
    assert [p.name for p in (entry.parent / ".versions").iterdir()] == [entry.resolve().name]
    upgraded = StandInBuilder(b"v3")
    build.run(make(tiny_export, store), store, device="NVIDIA H200", tensorrt_version="10.14.1",
              engine_builder=upgraded)
    assert upgraded.caches[0] is None  # the stored cache came from another TensorRT version
    uncached = StandInBuilder(b"v4")
    run_build(tiny_export, store, uncached, timing_cache=False)
    assert uncached.caches == [None, b"[full]"]  # no stored cache read; only this build's own
    assert not (entry / "timing.cache").exists() and manifest.read(entry)["timing_cache_sha256"] is None


def test_a_failing_build_leaves_the_previous_entry(tiny_export, tmp_path):
    store = EngineStore(tmp_path / "engines")
    entry = run_build(tiny_export, store, StandInBuilder(b"v1"))
    before = {p: p.read_bytes() for p in entry.rglob("*") if p.is_file()}

    def fails_on_cached(plan, graph, path, cache):
        if graph.name == "cached":
            raise builder.BuildError("TensorRT failed")
        return b"v2", b""

    with pytest.raises(builder.BuildError):
        run_build(tiny_export, store, fails_on_cached)
    assert {p: p.read_bytes() for p in entry.rglob("*") if p.is_file()} == before
    assert not list((entry.parent / ".versions").glob("*.partial"))


KILLED_BUILD = textwrap.dedent("""
    import sys, time
    from pathlib import Path
    from dlmrt.engines import build, targets
    from dlmrt.engines.plan import make_plan
    from dlmrt.engines.store import EngineStore

    export_dir, root, marker = map(Path, sys.argv[1:4])
    store = EngineStore(root)

    def slow_builder(plan, graph, path, cache):
        if graph.name == "cached":  # the full engine is written: stall until killed
            marker.write_text("building cached")
            time.sleep(600)
        return b"v2:" + graph.name.encode(), b"v2 cache"

    plan = make_plan(export_dir, targets.target_named("sm_90"), "bf16", tensorrt="10.13.0.35", store=root)
    build.run(plan, store, device="H200", tensorrt_version="10.13.0.35", engine_builder=slow_builder)
""")


def test_a_build_killed_midway_leaves_the_previous_engine_and_manifest(tiny_export, tmp_path):
    store = EngineStore(tmp_path / "engines")
    entry = run_build(tiny_export, store, StandInBuilder(b"v1"))
    before = {p.relative_to(entry): p.read_bytes() for p in entry.rglob("*") if p.is_file()}
    marker = tmp_path / "marker"
    process = subprocess.Popen([sys.executable, "-c", KILLED_BUILD, str(tiny_export), str(store.root),
                                str(marker)])
    try:
        deadline = time.monotonic() + 120
        while not marker.exists():
            assert process.poll() is None, "the build ended before it could be killed"
            assert time.monotonic() < deadline, "the build never reached its second graph"
            time.sleep(0.05)
        staged = list((entry.parent / ".versions").glob("*.partial/full/engine.plan"))
        assert staged and staged[0].read_bytes() == b"v2:full"  # killed with a new engine half-built
        os.kill(process.pid, signal.SIGKILL)
    finally:
        process.wait()
    assert {p.relative_to(entry): p.read_bytes() for p in entry.rglob("*") if p.is_file()} == before
    assert manifest.problems(entry, manifest.read(entry)) == []
    run_build(tiny_export, store, StandInBuilder(b"v3"))  # the next build clears the leftover
    assert not list((entry.parent / ".versions").glob("*.partial"))


def test_concurrent_builds_of_one_entry_are_refused(tiny_export, tmp_path):
    store = EngineStore(tmp_path / "engines")
    with store.writing("tiny-llada", "sm_90-bf16"):
        with pytest.raises(StoreError, match="another dlmrt build is writing sm_90-bf16"):
            run_build(tiny_export, store, StandInBuilder())


def test_a_directory_dlmrt_did_not_write_is_not_overwritten(tiny_export, tmp_path):
    store = EngineStore(tmp_path / "engines")
    user_dir = store.entry("tiny-llada", "sm_90-bf16")
    user_dir.mkdir(parents=True)
    (user_dir / "notes.txt").write_text("mine")
    with pytest.raises(StoreError, match="move it away"):
        run_build(tiny_export, store, StandInBuilder())
    assert (user_dir / "notes.txt").read_text() == "mine"


def test_a_changed_export_is_not_built(tiny_export, tmp_path):
    export = tmp_path / "export"
    export.mkdir()
    for path in tiny_export.iterdir():
        (export / path.name).write_bytes(path.read_bytes())
    plan = make(export, EngineStore(tmp_path / "engines"))
    with open(export / "step_full.onnx", "ab") as f:
        f.write(b"\0")
    with pytest.raises(build.PlanError, match="changed since it was exported"):
        build.run(plan, EngineStore(tmp_path / "engines"), device="H200", tensorrt_version=TENSORRT,
                  engine_builder=StandInBuilder())


@pytest.mark.parametrize("precision", ["nvfp4", "fp8"])
def test_a_quantized_build_builds_from_the_quantized_graph_that_passes_preflight(tiny_export, tmp_path, precision):
    if precision == "fp8":
        pytest.importorskip("modelopt", reason="FP8 quantization needs nvidia-modelopt (pip install 'dlmrt[quant]')")
    store = EngineStore(tmp_path / "engines")
    plan = make_plan(tiny_export, targets.target_named("sm_100"), precision, tensorrt=TENSORRT, store=store.root,
                     calibration_samples=8)
    steps = []
    entry = build.run(plan, store, device="NVIDIA B200", tensorrt_version=TENSORRT,
                      quantize=build.quantizer(plan, None), engine_builder=StandInBuilder(), on_step=steps.append)
    assert steps == [f"quantizing full ({precision})", f"quantizing cached ({precision})", "preflight",
                     "building full", "building cached"]
    record = manifest.read(entry)
    for graph in ("full", "cached"):
        quantized = entry / "quantized" / f"step_{graph}.onnx"
        info = record["graphs"][graph]
        assert info["built_from_sha256"] == hashlib.sha256(quantized.read_bytes()).hexdigest() != info["onnx_sha256"]
        assert (entry / info["engine"]).read_bytes().endswith(info["built_from_sha256"].encode())


# ---- selection --------------------------------------------------------------------------------------------

def test_selection_finds_the_engine_for_this_gpu(tiny_export, tmp_path):
    store = EngineStore(tmp_path / "engines")
    entry = run_build(tiny_export, store, StandInBuilder())
    selected = select(store, tiny_export, capability=CAPABILITY, tensorrt_version=TENSORRT)
    assert selected.entry == entry and selected.engine("full") == entry / "full" / "engine.plan"


def test_selection_refuses_a_mismatch_and_names_the_build_command(tiny_export, tmp_path):
    store = EngineStore(tmp_path / "engines")
    entry = run_build(tiny_export, store, StandInBuilder())
    command = f"dlmrt build {tiny_export} --target sm_100 --precision bf16 --output {store.root}"
    with pytest.raises(EngineMismatch, match=r"no sm_100 bf16 engine of tiny-llada .*it holds sm_90-bf16") as error:
        select(store, tiny_export, capability=(10, 0), tensorrt_version=TENSORRT)
    assert command in str(error.value)
    with pytest.raises(EngineMismatch, match=r"built with TensorRT 10.13.0.35, this is TensorRT 10.14.1"):
        select(store, tiny_export, capability=CAPABILITY, tensorrt_version="10.14.1")
    record = manifest.read(entry)
    record["plugins"][0]["version"] = "0"
    record["graphs"]["cached"]["onnx_sha256"] = "f" * 64
    (entry / "manifest.json").write_text(json.dumps(record))
    with pytest.raises(EngineMismatch) as error:
        select(store, tiny_export, capability=CAPABILITY, tensorrt_version=TENSORRT)
    assert "dlmrt::ParallelUnmask v0" in str(error.value)
    assert "cached engine was built from another export" in str(error.value)
    (entry / "cached" / "engine.plan").unlink()
    with pytest.raises(EngineMismatch, match="cached/engine.plan is missing"):
        select(store, tiny_export, capability=CAPABILITY, tensorrt_version=TENSORRT)


# ---- the command line -------------------------------------------------------------------------------------

def test_build_dry_run_prints_the_plan_and_preflight(tiny_export, tmp_path):
    result = CliRunner().invoke(main, ["build", str(tiny_export), "--target", "sm_100", "--precision", "nvfp4",
                                       "--batch", "1:2:4", "--workspace", "2GiB", "--tensorrt", "10.13",
                                       "--dry-run", "--json", "--output", str(tmp_path / "store")])
    assert result.exit_code == 0, result.output
    report = json.loads(result.output)
    plan = report["plan"]
    assert (plan["target"], plan["precision"], plan["typing"]) == ("sm_100", "nvfp4", "precision-flags")
    assert plan["builder_flags"] == ["FP4", "FP8", "BF16"]
    assert plan["ranges"]["batch"] == "1:2:4" and plan["options"]["workspace_bytes"] == 2 << 30
    assert plan["graphs"][0]["shapes"]["ids"] == [[1, 1], [2, 8], [4, 64]]
    assert report["preflight"] == []
    assert not (tmp_path / "store").exists()  # a dry run writes nothing
    table = CliRunner().invoke(main, ["build", str(tiny_export), "--target", "sm_90", "--dry-run",
                                      "--tensorrt", "10.13"])
    assert table.exit_code == 0 and "--minShapes=ids:1x1" in table.output and "preflight: the export" in table.output
    flags = [line for line in table.output.splitlines() if "--minShapes=" in line]  # whole lines, to paste
    assert len(flags) == 2 and all("--onnx=" in line and "--maxShapes=" in line and "│" not in line for line in flags)


@pytest.mark.parametrize("arguments, message", [
    (["--target", "sm_90", "--precision", "nvfp4", "--dry-run"], "nvfp4 needs compute capability 10.0"),
    (["--target", "sm_89", "--batch", "1:4:99", "--tensorrt", "10.13", "--dry-run"], "max-batch"),
    (["--target", "sm_89", "--workspace", "lots", "--tensorrt", "10.13", "--dry-run"], "--workspace 'lots'"),
    (["--target", "sm_90", "--tensorrt", "11.4", "--dry-run"], "export in bfloat16"),
])
def test_build_refuses_bad_requests_with_one_line(tiny_export, arguments, message):
    result = CliRunner().invoke(main, ["build", str(tiny_export), *arguments])
    assert result.exit_code == 2 and message in result.output and "Traceback" not in result.output, result.output


@pytest.mark.skipif(builder.installed_tensorrt() is not None, reason="TensorRT is installed here")
def test_build_without_tensorrt_says_how_to_get_it(tiny_export):
    result = CliRunner().invoke(main, ["build", str(tiny_export), "--target", "sm_90"])
    assert result.exit_code == 2 and "pip install 'dlmrt[tensorrt]'" in result.output


def test_inspect_shows_a_manifest_and_fails_on_a_bad_hash(tiny_export, tmp_path):
    store = EngineStore(tmp_path / "engines")
    entry = run_build(tiny_export, store, StandInBuilder())
    for path in (entry, store.root):
        result = CliRunner().invoke(main, ["inspect", str(path)])
        assert result.exit_code == 0 and "every engine and the timing cache match" in result.output, result.output
    (entry / "timing.cache").write_bytes(b"other")
    result = CliRunner().invoke(main, ["inspect", str(entry), "--json"])
    assert result.exit_code == 1
    assert "timing.cache has sha256" in json.loads(result.output)[0]["problems"][0]
    result = CliRunner().invoke(main, ["inspect", str(tmp_path)])
    assert result.exit_code == 2 and "holds no engine" in result.output


# ---- TensorRT itself (where installed) --------------------------------------------------------------------

@pytest.mark.trt
@pytest.mark.gpu
def test_tensorrt_builds_the_tiny_models_engines(request, tmp_path):
    version = builder.installed_tensorrt()
    if version is None:
        pytest.skip("TensorRT is not installed (it cannot be installed on the CPU machines)")
    if targets.running_gpu() is None:
        pytest.skip("no CUDA GPU: TensorRT builds for the GPU it runs on")
    capability, name = targets.running_gpu()
    target = targets.target_for_capability(capability, name)
    tiny_export = request.getfixturevalue("tiny_export")
    store = EngineStore(tmp_path / "engines")
    plan = make_plan(tiny_export, target, "fp16", tensorrt=version, store=store.root) \
        if int(version.split(".")[0]) < 11 else None
    if plan is None:
        pytest.skip("TensorRT 11 needs a 16-bit export for fp16; covered by scripts/gpu_check.sh")
    entry = build.run(plan, store, device=name, tensorrt_version=version)
    assert manifest.problems(entry, manifest.read(entry)) == []
    assert select(store, tiny_export, capability=capability, tensorrt_version=version,
                  precision="fp16").entry == entry


def test_a_build_runs_only_on_the_gpu_it_targets(tiny_export, tmp_path, monkeypatch):
    plan = make_plan(tiny_export, targets.target_named("sm_100"), "bf16", tensorrt=TENSORRT, store=tmp_path)
    monkeypatch.setattr(targets, "running_gpu", lambda: ((9, 0), "NVIDIA H200"))
    with pytest.raises(targets.TargetError, match=r"this is NVIDIA H200 \(sm_90\), the plan is for sm_100"):
        build.check_running_gpu(plan)
    monkeypatch.setattr(targets, "running_gpu", lambda: ((10, 0), "NVIDIA B200"))
    assert build.check_running_gpu(plan) == "NVIDIA B200"
    assert targets.resolve("auto").name == "sm_100"
    monkeypatch.setattr(targets, "running_gpu", lambda: None)
    with pytest.raises(targets.TargetError, match="no CUDA GPU"):
        build.check_running_gpu(plan)


def test_build_without_the_onnx_extra_says_which_to_install(tiny_export, monkeypatch):
    import importlib.util

    find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "onnxscript" else
                        find_spec(name, *a))
    result = CliRunner().invoke(main, ["build", str(tiny_export), "--target", "sm_90", "--dry-run"])
    assert result.exit_code == 2 and "pip install 'dlmrt[onnx]'" in result.output, result.output


def test_inspect_needs_no_onnx(tmp_path):
    code = ("import sys; sys.modules['onnx'] = None; from dlmrt.cli.commands import main; "
            "main(['inspect', sys.argv[1]])")
    result = subprocess.run([sys.executable, "-c", code, str(tmp_path)], capture_output=True, text=True)
    assert result.returncode == 2 and "holds no engine" in result.stderr, result.stderr


def test_inspect_for_an_export_picks_the_engine_or_says_why_none_fits(tiny_export, tmp_path):
    store = EngineStore(tmp_path / "engines")
    entry = run_build(tiny_export, store, StandInBuilder())
    select_args = ["inspect", str(store.root), "--for", str(tiny_export), "--tensorrt", TENSORRT]
    result = CliRunner().invoke(main, [*select_args, "--target", "sm_90", "--json"])
    assert result.exit_code == 0, result.output
    assert json.loads(result.output)[0]["entry"] == str(entry)
    result = CliRunner().invoke(main, [*select_args, "--target", "sm_90", "--precision", "fp8"])
    assert result.exit_code == 2 and "no sm_90 fp8 engine of tiny-llada" in result.output
    assert f"dlmrt build {tiny_export} --target sm_90 --precision fp8" in result.output
