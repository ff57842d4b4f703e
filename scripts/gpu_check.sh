#!/usr/bin/env bash
# Every check that needs a GPU or TensorRT, in one bounded run, ending with a short table.
#
#   scripts/gpu_check.sh                                  # on a machine with an NVIDIA GPU (TensorRT optional)
#   GPU_CHECK_ONLY=gpu-tests,backends scripts/gpu_check.sh   # a subset of the steps below, by name
#   GPU_CHECK_SKIP=latency-compile scripts/gpu_check.sh      # all but these
#   GPU_CHECK_BUDGET=300 scripts/gpu_check.sh                # the whole run's time limit in seconds [465]
#
# The steps: first those that failed on the first H200 run (docs/gpu-runs.md), then the roofline profiles, then
# the benchmarks. Each has its own time limit, cut to what is left of the budget (less 15 s for the table); a
# step that no longer fits is recorded as skipped, so the run always ends with its table.
#   gpu-tests                the tests marked `gpu` or `trt` (4 xdist workers): the Triton kernels compiled
#                            and run on the device, CUDA-graph capture of the steps, the parity matrix's
#                            CUDA-graph column, the running batch under CUDA graphs, the NVIDIA paths of
#                            quantization, and the TensorRT builds and TrtBackend's agreement with torch where
#                            TensorRT is installed
#   parity-cudagraph-first   the parity tests below that failed on the first H200 run (rows stopping at EOS
#                            and leaving the batch, LLaDA2's policy against its generate): 9 tests, one worker each
#   bench-diffusion-gemma    `dlmrt bench` on the tiny DiffusionGemma's uniform-noise loop, eager vs CUDA graphs
#   parity-cudagraph         the step loop's other parity tests (every test taking the `loop` fixture in
#                            tests/runtime/test_generator.py, test_llada21.py, test_dream_decoding.py: about
#                            400) under CUDA graphs at K = 1, 4 and a whole block (8 xdist workers)
#   roofline-llada-8b        `dlmrt bench --roofline --device cuda`: each part of LLaDA-8B's step (bf16, dual cache,
#                            prompt 512, block 32) measured by torch.profiler beside its floor, batch 1 and 8
#   roofline-llada-8b-fp8    the same with --precision fp8 (docs/fp8.md): the blocks' linears through _scaled_mm,
#                            batch 1, against the fp8 floor
#   roofline-llada2.1-mini   the same for LLaDA2.1-mini's shapes (256 experts, top 8; prefix cache), batch 1 and 32
#   bench-llada2.1-mini-b1, -b32   `dlmrt bench` on LLaDA2.1-mini's shapes under CUDA graphs: tokens/s, ms/step
#   latency-eager-cudagraph  scripts/bench_step_latency.py on LLaDA-8B shapes (random bf16 weights made on
#                            the GPU): ms per step at K = 1 and a whole block against the HBM floor, and the
#                            unmask step's Triton kernels against the torch reference
#   unmask-kernels           the unmask step alone at vocabulary 126,464, batch 1 and 64, greedy and t=0.8: the
#                            torch reference (fp32, bf16 by slices) and every Triton form (two kernels, fused, split)
#   bench-llada-8b           `dlmrt bench` on LLaDA-8B's shapes, eager vs CUDA graphs, bf16 and fp8
#   nccl-tp                  scripts/tp_check.py: the tiny LLaDA and DiffusionGemma split over NCCL ranks (one per GPU,
#                            at most 2; one GPU runs one NCCL rank and says so), tokens against one process, eager
#                            and CUDA graphs
#   export, plan             the tiny model's export, and its fp8 build plan for the running GPU (dry run);
#                            plan, the TensorRT steps and backends' --export need export in the same run
#   build-bf16, build-fp8, inspect, generate-trt   only where TensorRT is installed
#   backends                 scripts/bench_backends.py: the tiny export through every backend on the GPU
#   latency-compile          bench_step_latency.py under torch.compile (slow to compile: last, on what is left)
#
# The test steps print each failure's traceback (--tb=short) as it happens, so that a step cut by its time
# limit still shows them, and give each xdist worker its share of the CPU threads: the parity tests' CPU
# references (LLaDA2's generate over a MoE model) crawl when 8 workers each run torch on every core.
#
# What comes back, in $OUT (else a temp dir), six files: gpu_check.out (this script's output), summary.txt
# (the closing table), logs.txt (every step's log, each's last MiB), results.json (the environment, each
# step's outcome, the test results, every benchmark's JSON), gpu-tests.xml (JUnit) and logs.tar.gz (the
# full logs, JUnit files and JSON). Scratch (the export, DLMRT_HOME, compiler caches) stays in a temp dir.
# Nothing is downloaded: dlmrt is installed with `pip --no-index --no-build-isolation --no-deps -e .`, and
# where that fails, the tree is put on PYTHONPATH (GPU_CHECK_INSTALL=path forces it).
set -uo pipefail
cd "$(dirname "$0")/.." || exit 1
repo=$PWD
budget=${GPU_CHECK_BUDGET:-465}
reserve=15  # seconds kept for the table and packing at the end
python=${PYTHON:-python3}
out=${OUT:-$(mktemp -d)}
work=$(mktemp -d "${TMPDIR:-/tmp}/gpu-check.XXXXXX")
mkdir -p "$out" "$work/logs" "$work/json"
export DLMRT_HOME="$work/dlmrt-home" PYTHONUNBUFFERED=1 PYTHONDONTWRITEBYTECODE=1 PIP_DISABLE_PIP_VERSION_CHECK=1 \
    TORCHINDUCTOR_CACHE_DIR="$work/inductor" TRITON_CACHE_DIR="$work/triton" MPLBACKEND=Agg
unset TRITON_INTERPRET  # the GPU tests skip when the process interprets Triton
steps="$work/steps.tsv"
: > "$steps"
main() {  # all of it, its output also in $OUT/gpu_check.out (see the last line)
echo "gpu_check: budget ${budget} s, results in $out, scratch in $work"

# -- dlmrt importable from this tree, without the network ---------------------------------------------
imports_here() {
    "$python" - "$repo" <<'PY' 2>/dev/null
import pathlib, sys
import dlmrt, dlmrt.export, dlmrt.runtime, dlmrt.engines, dlmrt.ops
repo = pathlib.Path(sys.argv[1]).resolve()
sys.exit(0 if pathlib.Path(dlmrt.__file__).resolve().parent == repo / "dlmrt" else 1)
PY
}
install_dlmrt() {
    if [ "${GPU_CHECK_INSTALL:-auto}" != path ]; then
        if imports_here; then echo "dlmrt: already importable from this tree"; return 0; fi
        if timeout 120 "$python" -m pip install -q --no-deps --no-build-isolation --no-index -e . \
                > "$work/logs/install.log" 2>&1 && imports_here; then
            echo "dlmrt: installed editable"; return 0
        fi
        echo "dlmrt: the editable install failed (its log's end below); putting this tree on PYTHONPATH"
        tail -n 5 "$work/logs/install.log"
    fi
    export PYTHONPATH="$repo${PYTHONPATH:+:$PYTHONPATH}"
    if imports_here; then echo "dlmrt: on PYTHONPATH from $repo"; return 0; fi
    echo "dlmrt: cannot be imported; the steps below will fail"
    "$python" -c "import dlmrt.export" 2>&1 | tail -n 3
}
install_dlmrt

# -- the environment ----------------------------------------------------------------------------------
echo "== environment"
timeout 20 nvidia-smi --query-gpu=name,compute_cap,driver_version,memory.total,memory.used,clocks.max.sm \
    --format=csv,noheader || echo "nvidia-smi: no GPU"
echo "cpus: $(nproc), memory: $(free -g 2>/dev/null | awk '/Mem:/ {print $2 " GiB"}'), python: $(command -v "$python")"
timeout 60 "$python" - "$work/environment.json" <<'PY' || echo "environment: the probe failed"
import importlib, importlib.metadata, json, platform, sys
facts = {"python": platform.python_version()}
try:
    import torch
    facts.update(torch=torch.__version__, torch_cuda=torch.version.cuda, cuda_available=torch.cuda.is_available())
    if torch.cuda.is_available():
        props = torch.cuda.get_device_properties(0)
        facts.update(gpu=torch.cuda.get_device_name(0), capability=".".join(map(str, torch.cuda.get_device_capability(0))),
                     gpu_memory_gib=round(props.total_memory / 2**30, 1), multiprocessors=props.multi_processor_count)
except Exception as error:  # noqa: BLE001
    facts["torch_error"] = f"{type(error).__name__}: {error}"
for name, module in (("triton", "triton"), ("tensorrt", "tensorrt"), ("modelopt", "modelopt"), ("onnx", "onnx"),
                     ("onnxruntime", "onnxruntime"), ("onnxscript", "onnxscript"), ("polygraphy", "polygraphy"),
                     ("pytest", "pytest"), ("xdist", "xdist"), ("pytest_timeout", "pytest_timeout"),
                     ("setuptools", "setuptools")):
    try:
        facts[name] = getattr(importlib.import_module(module), "__version__", "present")
    except Exception as error:  # noqa: BLE001
        facts[name] = f"absent ({type(error).__name__})"
try:
    import onnxruntime
    facts["onnxruntime_providers"] = onnxruntime.get_available_providers()
except Exception:  # noqa: BLE001
    pass
try:
    import dlmrt
    facts["dlmrt"] = dlmrt.__file__
except Exception as error:  # noqa: BLE001
    facts["dlmrt"] = f"not importable: {type(error).__name__}: {error}"
for key, value in facts.items():
    print(f"{key}: {value}")
json.dump(facts, open(sys.argv[1], "w"), indent=2)
PY

# -- the steps ----------------------------------------------------------------------------------------
want() {  # want NAME: whether GPU_CHECK_ONLY / GPU_CHECK_SKIP let the step run
    if [ -n "${GPU_CHECK_ONLY:-}" ] && [[ ",$GPU_CHECK_ONLY," != *",$1,"* ]]; then return 1; fi
    if [ -n "${GPU_CHECK_SKIP:-}" ] && [[ ",$GPU_CHECK_SKIP," == *",$1,"* ]]; then return 1; fi
    return 0
}
step() {  # step NAME LIMIT COMMAND...: run one command within its limit and what is left; record its outcome
    local name=$1 limit=$2 rc status t0 left; shift 2
    want "$name" || return 0
    left=$((budget - SECONDS - reserve))
    if ((left < 20)); then
        printf '%s\tskipped (time budget spent)\t0\n' "$name" >> "$steps"
        echo "== $name: skipped, the time budget is spent"
        return 0
    fi
    ((limit > left)) && limit=$left
    echo "== $name (limit ${limit} s, at ${SECONDS} s)"
    t0=$SECONDS
    timeout -k 10 "$limit" "$@" < /dev/null > "$work/logs/$name.log" 2>&1
    rc=$?
    case $rc in
        0) status=passed ;;
        124 | 137) status="timed out (${limit} s)" ;;
        *) status="failed (exit $rc)" ;;
    esac
    printf '%s\t%s\t%s\n' "$name" "$status" "$((SECONDS - t0))" >> "$steps"
    echo "   $status in $((SECONDS - t0)) s"
    { echo "===== $name: $status in $((SECONDS - t0)) s: $*"; tail -c 1048576 "$work/logs/$name.log"; echo; } \
        >> "$out/logs.txt"
}
# Each failure's report printed when it comes in (a pytest plugin, on the tests' PYTHONPATH).
mkdir -p "$work/plugins"
cat > "$work/plugins/gpu_check_failures.py" <<'PY'
"""pytest plugin: each failure's report (as --tb asks) printed as it comes in, not only at the end."""
import pytest

_config = None


def pytest_configure(config):
    global _config
    _config = config


@pytest.hookimpl(trylast=True)
def pytest_runtest_logreport(report):
    if not report.failed or _config is None or hasattr(_config, "workerinput"):  # the controller prints
        return
    reporter = _config.pluginmanager.get_plugin("terminalreporter")
    if reporter is not None:
        reporter.ensure_newline()
        reporter.write_sep("-", f"{report.nodeid} failed ({report.when}), at once")
        reporter.write_line(report.longreprtext)
PY
pytest_options=(-p no:cacheprovider -p gpu_check_failures -v -rfEs --tb=short --continue-on-collection-errors)
# per test, where pytest-timeout and pytest-xdist are installed: a hung test fails alone, and a crashed
# worker (a segfault in a kernel) fails its test rather than the whole run
per_test() { if "$python" -c "import pytest_timeout" 2>/dev/null; then echo "--timeout $1"; fi; }
workers() { if "$python" -c "import xdist" 2>/dev/null; then echo "-n $1"; fi; }
pytest_on() {  # pytest_on WORKERS: `pytest` (an array) becomes pytest's command line on that many xdist workers,
    local threads=$(($(nproc) / $1))  # each with its share of the CPU threads
    ((threads < 1)) && threads=1
    # shellcheck disable=SC2046
    pytest=(env "PYTHONPATH=$work/plugins${PYTHONPATH:+:$PYTHONPATH}" "OMP_NUM_THREADS=$threads"
            "MKL_NUM_THREADS=$threads" "$python" -m pytest "${pytest_options[@]}" $(workers "$1"))
}
# The parity tests that failed on the first H200 run (9 of about 400): run first, on a worker each.
first_parity=(tests/runtime/test_generator.py::test_a_row_stops_after_the_block_holding_eos
              tests/runtime/test_generator.py::test_finished_rows_leave_the_batch)
for case in K1-12-0.95-4-none K4-12-0.95-4-prefix Kblock-10-0.2-4-none; do
    first_parity+=("tests/runtime/test_generator.py::test_llada2_policy_decodes_as_llada2s_generate[cudagraph-$case]")
done
not_first=()
for test in "${first_parity[@]}"; do not_first+=(--deselect "$test"); done

pytest_on 4
# shellcheck disable=SC2046
step gpu-tests 150 "${pytest[@]}" -m "gpu or trt" $(per_test 90) --junitxml "$work/gpu-tests.xml" tests
pytest_on 9
# shellcheck disable=SC2046
step parity-cudagraph-first 90 "${pytest[@]}" $(per_test 60) --loop-modes cudagraph \
    --junitxml "$work/parity-cudagraph-first.xml" "${first_parity[@]}"
step bench-diffusion-gemma 60 "$python" -m dlmrt.cli bench --model dlmrt/assets/tiny-diffusion-gemma --device cuda \
    --policy entropy_bound --backend torch:eager,torch:cudagraph --batch-size 4 --input-len 12 --output-len 32 \
    --block-length 16 --output-json "$work/json/bench-diffusion-gemma.json"
pytest_on 8
# shellcheck disable=SC2046
step parity-cudagraph 180 "${pytest[@]}" $(per_test 60) --loop-modes cudagraph -k cudagraph "${not_first[@]}" \
    --junitxml "$work/parity-cudagraph.xml" tests/runtime/test_generator.py tests/runtime/test_llada21.py \
    tests/runtime/test_dream_decoding.py
roofline_gpu=$("$python" -c "import torch; print('h100' if 'H100' in torch.cuda.get_device_name() else 'h200')" \
               2>/dev/null || echo h200)
step roofline-llada-8b 90 "$python" -m dlmrt.cli bench --roofline --model llada-8b --device cuda --dtype bfloat16 \
    --batch-size 1,8 --input-len 512 --output-len 32 --gpu "$roofline_gpu" --output-json "$work/json/roofline-llada-8b.json"
step roofline-llada-8b-fp8 60 "$python" -m dlmrt.cli bench --roofline --model llada-8b --device cuda \
    --dtype bfloat16 --precision fp8 --batch-size 1 --input-len 512 --output-len 32 --gpu "$roofline_gpu" \
    --output-json "$work/json/roofline-llada-8b-fp8.json"
step roofline-llada2.1-mini 90 "$python" -m dlmrt.cli bench --roofline --model llada2.1-mini --device cuda \
    --dtype bfloat16 --batch-size 1,32 --input-len 512 --output-len 32 --gpu "$roofline_gpu" \
    --output-json "$work/json/roofline-llada2.1-mini.json"
for batch in 1 32; do
    step "bench-llada2.1-mini-b$batch" 60 "$python" -m dlmrt.cli bench --model llada2.1-mini --device cuda \
        --dtype bfloat16 --backend torch:cudagraph --batch-size "$batch" --input-len 512 --output-len 32 --num-iters 3 \
        --output-json "$work/json/bench-llada2.1-mini-b$batch.json"
done
step latency-eager-cudagraph 120 "$python" scripts/bench_step_latency.py --modes eager,cudagraph \
    --json "$work/json/latency-eager-cudagraph.json"
step unmask-kernels 60 "$python" scripts/bench_step_latency.py --unmask-only --batches 1,64 \
    --json "$work/json/unmask-kernels.json"
step bench-llada-8b 90 "$python" -m dlmrt.cli bench --model llada-8b --device cuda --dtype bfloat16 \
    --backend torch:eager,torch:cudagraph,torch:cudagraph:fp8 --input-len 512 --output-len 32 --num-iters 3 \
    --output-json "$work/json/bench-llada-8b.json"
step nccl-tp 90 "$python" scripts/tp_check.py --device cuda --ranks 2 --json "$work/json/nccl-tp.json"
export_dir="$work/tiny-export"
step export 60 "$python" -m dlmrt.cli export -o "$export_dir" --max-batch 8 --max-length 64
[ -d "$export_dir" ] && step plan 30 "$python" -m dlmrt.cli build "$export_dir" --target auto --precision fp8 --dry-run
precisions=""
if [ -d "$export_dir" ] && "$python" -c "import tensorrt" 2>/dev/null; then
    step build-bf16 180 "$python" -m dlmrt.cli build "$export_dir" --target auto --precision bf16
    step build-fp8 180 "$python" -m dlmrt.cli build "$export_dir" --target auto --precision fp8
    step inspect 30 "$python" -m dlmrt.cli inspect "$DLMRT_HOME/engines"
    step generate-trt 60 "$python" -m dlmrt.cli generate --backend trt --model "$export_dir" --precision fp8 \
        --prompt "add:762+139=" --metrics
    precisions=bf16,fp8
fi
export_option=()  # without the export step, bench_backends.py exports to a temp dir itself
[ -d "$export_dir" ] && export_option=(--export "$export_dir")
step backends 75 "$python" scripts/bench_backends.py "${export_option[@]}" --precisions "$precisions" \
    --json "$work/json/backends.json"
step latency-compile 180 "$python" scripts/bench_step_latency.py --modes compile \
    --json "$work/json/latency-compile.json"

# -- what comes back ----------------------------------------------------------------------------------
for log in roofline-llada-8b roofline-llada-8b-fp8 roofline-llada2.1-mini bench-llada2.1-mini-b1 bench-llada2.1-mini-b32 \
           latency-eager-cudagraph unmask-kernels bench-llada-8b nccl-tp backends bench-diffusion-gemma latency-compile; do
    [ -s "$work/logs/$log.log" ] || continue  # the benchmarks' own tables, before the summary
    echo "===== $log (the end of its log)"
    grep -v -E '^  (eager|compile|cudagraph) K=' "$work/logs/$log.log" | tail -n 30
done
[ -f "$work/gpu-tests.xml" ] && cp "$work/gpu-tests.xml" "$out/"
timeout 60 "$python" - "$work" "$out" "$budget" <<'PY' || cat "$steps"
"""The closing table (also summary.txt) and results.json; only the standard library."""
import json
import re
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

work, out, budget = Path(sys.argv[1]), Path(sys.argv[2]), sys.argv[3]
LINE = re.compile(r"^(?:\[gw\d+\] \[\s*\d+%\] (?P<o1>PASSED|FAILED|ERROR|SKIPPED|XFAIL|XPASS) (?P<n1>\S+::\S+)"
                  r"|(?P<n2>\S+::\S+) (?P<o2>PASSED|FAILED|ERROR|SKIPPED|XFAIL|XPASS)\b)")


def short(text, width):
    text = " ".join(str(text or "").split())
    return text if len(text) <= width else text[:width - 1] + "~"


def junit_cases(path):
    cases = []
    for case in ET.parse(path).iter("testcase"):
        outcome, message = "passed", ""
        for child in case:
            if child.tag in ("failure", "error", "skipped"):
                outcome = {"failure": "failed", "error": "error", "skipped": "skipped"}[child.tag]
                message = child.get("message") or ((child.text or "").strip().splitlines() or [""])[-1]
        name = f"{(case.get('classname') or '').split('.')[-1]}::{case.get('name')}"
        cases.append({"name": name, "outcome": outcome, "seconds": float(case.get("time") or 0), "message": message})
    return cases


def log_cases(path):  # where pytest was stopped before it wrote its JUnit file: the -v lines of its log
    found = {}
    for line in path.read_text(errors="replace").splitlines():
        match = LINE.match(line)
        if match:
            name = match.group("n1") or match.group("n2")
            outcome = (match.group("o1") or match.group("o2")).lower()
            found[name.split("/")[-1].replace(".py::", "::")] = {"passed": "passed", "failed": "failed",
                                                                 "error": "error", "skipped": "skipped"}.get(
                                                                     outcome, outcome)
    return [{"name": n, "outcome": o, "seconds": 0.0, "message": "(from the log)"} for n, o in found.items()]


def counts(cases):
    tally = {}
    for case in cases:
        tally[case["outcome"]] = tally.get(case["outcome"], 0) + 1
    return ", ".join(f"{n} {o}" for o, n in sorted(tally.items())) or "no test ran"


environment = {}
if (work / "environment.json").exists():
    environment = json.loads((work / "environment.json").read_text())
steps, tests = [], {}
for line in (work / "steps.tsv").read_text().splitlines():
    name, outcome, seconds = line.split("\t")
    detail = ""
    xml, log = work / f"{name}.xml", work / "logs" / f"{name}.log"
    if name in ("gpu-tests", "parity-cudagraph-first", "parity-cudagraph"):
        try:
            tests[name] = junit_cases(xml) if xml.exists() else log_cases(log) if log.exists() else []
        except Exception as error:  # noqa: BLE001
            tests[name] = []
            detail = f"unreadable results: {error}"
        detail = detail or counts(tests[name]) + ("" if xml.exists() else " (JUnit missing: from the log)")
    elif outcome != "passed" and log.exists():
        lines = [x for x in (re.sub(r"[\u2500-\u257f]+", " ", x).strip()
                             for x in log.read_text(errors="replace").splitlines()) if x]
        errors = [x for x in lines if re.search(r"(Error|Exception|error:)", x)]
        detail = short((errors or lines or [""])[-1], 70)
    steps.append({"step": name, "result": outcome, "seconds": int(seconds), "detail": detail})

key = []  # a few figures from the benchmarks' JSON
benchmarks = {}
for path in sorted((work / "json").glob("*.json")):
    try:
        data = benchmarks[path.stem] = json.loads(path.read_text())
        if path.stem.startswith("latency"):
            figures = [f"floor {data['floor_ms']:.2f}"] + [
                f"{r['mode']} K{r['k']} " + (f"{r['ms_per_step']:.2f}" if "ms_per_step" in r else "error")
                for r in data["decode"]]
            figures += [f"{r['kernel']} t{r['temperature']} " + (f"{r['us']:.0f}us" if "us" in r else "error")
                        for r in data.get("unmask", [])[:6] if path.stem.endswith("cudagraph")]
            key.append(f"{path.stem} ms/step: " + "; ".join(figures))
        elif path.stem.startswith("roofline"):
            for case in data["cases"]:
                total = case["total"]
                if "measured_s" not in total:
                    key.append(f"{path.stem} batch {case['batch']}: floor {1e3 * case['floor_s']:.2f} ms, not measured")
                    continue
                worst = max(case["rows"], key=lambda r: r.get("measured_s", 0.0) - r["floor_s"])
                key.append(f"{path.stem} batch {case['batch']}: {1e3 * total['measured_s']:.2f} ms measured, floor "
                           f"{1e3 * case['floor_s']:.2f} ms ({total['measured_s'] / case['floor_s']:.2f}x); most "
                           f"over its floor: {worst['name']} {1e3 * worst.get('measured_s', 0.0):.2f} / "
                           f"{1e3 * worst['floor_s']:.2f} ms")
        elif path.stem == "backends":
            key.append("backends ms/step (same tokens): " + "; ".join(
                f"{r['setting']} " + (f"{r['ms_per_step']:.2f} ({'yes' if r.get('same_tokens') else 'NO'})"
                                      if "ms_per_step" in r else "error") for r in data["cases"]))
        else:
            for scenario in data["scenarios"].values():
                key.append(f"{path.stem} step p50 ms, tokens/s (same tokens): " + "; ".join(
                    f"{r['setting']} {1e3 * r['step_p50_s']:.2f}, {r['tokens_per_s']:.0f} ({r.get('same_tokens')})"
                    for r in scenario["cases"]))
    except Exception as error:  # noqa: BLE001
        key.append(f"{path.stem}: unread ({type(error).__name__}: {error})")

rows = [f"GPU check: {environment.get('gpu', 'no CUDA GPU')} (sm {environment.get('capability', '-')}), "
        f"torch {environment.get('torch', '?')}, triton {environment.get('triton', '?')}, "
        f"tensorrt {environment.get('tensorrt', '?')}, onnxruntime {environment.get('onnxruntime', '?')} "
        f"{environment.get('onnxruntime_providers', '')}; budget {budget} s",
        "", f"{'step':<26} {'result':<24} {'s':>4}  detail"]
rows += [f"{s['step']:<26} {short(s['result'], 24):<24} {s['seconds']:>4}  {short(s['detail'], 80)}" for s in steps]
for name, cases in tests.items():  # every GPU test; of the parity tests, those that did not pass
    modules = [c for c in cases if c["name"].startswith("::") and c["outcome"] == "skipped"]  # importorskip
    shown = [c for c in cases if c not in modules and (name == "gpu-tests" or c["outcome"] in ("failed", "error"))]
    shown.sort(key=lambda c: c["name"])
    if shown:
        rows += ["", f"{name}:" if name == "gpu-tests" else f"{name}, the failures and errors (first 25 of "
                                                            f"{len(shown)}):"]
        width = min(100, max(len(c["name"]) for c in shown))
        rows += [f"  {short(c['name'], width):<{width}} {c['outcome']:<7} {c['seconds']:>5.1f}"
                 + (f"  {short(c['message'], 50)}" if c["outcome"] != "passed" and c["message"] else "")
                 for c in shown[:None if name == "gpu-tests" else 25]]
    if modules:
        rows.append(f"  (test modules skipped whole, missing packages: {', '.join(c['name'][2:] for c in modules)})")
if key:
    rows += ["", "key figures:"] + [f"  {short(line, 400)}" for line in key]
table = "\n".join(rows)
(out / "summary.txt").write_text(table + "\n")
(out / "results.json").write_text(json.dumps({"environment": environment, "steps": steps, "tests": tests,
                                              "benchmarks": benchmarks}, indent=1))
print("\n" + table)
PY
(cd "$work" && tar -czf "$out/logs.tar.gz" --ignore-failed-read logs json steps.tsv ./*.xml environment.json \
    2>/dev/null) || [ -s "$out/logs.tar.gz" ] || echo "logs.tar.gz: tar failed"
echo "gpu_check: done in ${SECONDS} s; files in $out: $(cd "$out" && echo *)"
}
main 2>&1 | tee "$out/gpu_check.out"
