#!/usr/bin/env bash
# Every check that needs a GPU or TensorRT, in one run, ending with a short table.
#
#   scripts/gpu_check.sh            # on a machine with an NVIDIA GPU (TensorRT optional)
#
# Runs the tests marked `gpu` or `trt` (the Triton kernels compiled and run on the device, the NVIDIA
# GPU paths of quantization, TensorRT builds where TensorRT is installed), the step loop's parity
# tests under CUDA graphs (K = 1, 4 and a whole block), the step-latency benchmark on LLaDA-8B shapes
# (scripts/bench_step_latency.py: eager and CUDA graphs, then torch.compile on its own time limit),
# then plans (and, with TensorRT, builds, inspects and generates through) the tiny model's bf16 and
# fp8 engines for the running GPU; the `trt` tests include TrtBackend's token agreement with torch on
# real engines. Last, scripts/bench_backends.py runs the tiny export through every backend on the GPU
# (torch eager and CUDA graphs, ONNX Runtime's CUDA provider with and without CUDA graphs, and the
# TensorRT engines built here): token agreement with torch and step latency against torch's CUDA
# graphs; `dlmrt bench` on LLaDA-8B's shapes, eager against CUDA graphs; and the tiny DiffusionGemma's
# uniform-noise loop, eager against CUDA graphs (its test, `gpu`-marked, checks their tokens). Sized to finish in
# under 8 minutes; each step has its own time limit. Results and logs go to $OUT (else a temp dir).
set -uo pipefail
cd "$(dirname "$0")/.."
results=${OUT:-$(mktemp -d)}
mkdir -p "$results"
python=${PYTHON:-python3}
export DLMRT_HOME="$results/dlmrt-home"

if ! "$python" -c "import dlmrt" 2>/dev/null; then
    "$python" -m pip install --no-deps -q -e . || exit 1
fi
nvidia-smi --query-gpu=name,compute_cap,driver_version --format=csv,noheader || echo "nvidia-smi: no GPU"
"$python" - <<'PY'
import importlib.util, torch
print(f"torch {torch.__version__}, CUDA {torch.version.cuda}, GPU: {torch.cuda.is_available()}")
for name in ("triton", "tensorrt", "modelopt", "onnxruntime"):
    spec = importlib.util.find_spec(name)
    print(f"{name}: {'present' if spec else 'absent'}")
PY

timeout 360 "$python" -m pytest -m "gpu or trt" -rs -q -p no:cacheprovider \
    --junitxml "$results/gpu_tests.xml" tests 2>&1 | tee "$results/gpu_tests.log"

steps="$results/steps.tsv"
: > "$steps"
step() {  # step NAME LIMIT COMMAND...: run one command, record its outcome and time
    local name=$1 limit=$2; shift 2
    local started=$SECONDS
    if timeout "$limit" "$@" > "$results/$name.log" 2>&1; then status=passed; else status="failed ($?)"; fi
    printf '%s\t%s\t%s\n' "$name" "$status" "$((SECONDS - started))" >> "$steps"
}
step parity-cudagraph 150 "$python" -m pytest -q -p no:cacheprovider tests/runtime/test_generator.py --loop-modes cudagraph
step parity-editing-dream-cudagraph 150 "$python" -m pytest -q -p no:cacheprovider tests/runtime/test_llada21.py \
    tests/runtime/test_dream_decoding.py --loop-modes cudagraph -k "public or reference or alone"
step latency-eager-cudagraph 150 "$python" scripts/bench_step_latency.py --modes eager,cudagraph \
    --json "$results/latency_eager_cudagraph.json"
step latency-compile 150 "$python" scripts/bench_step_latency.py --modes compile --json "$results/latency_compile.json"
export_dir="$results/tiny-export"
step export 120 "$python" -m dlmrt.cli export -o "$export_dir" --max-batch 8 --max-length 64
step plan 60 "$python" -m dlmrt.cli build "$export_dir" --target auto --precision fp8 --dry-run
precisions=""
if "$python" -c "import tensorrt" 2>/dev/null; then
    step build-bf16 180 "$python" -m dlmrt.cli build "$export_dir" --target auto --precision bf16
    step build-fp8 180 "$python" -m dlmrt.cli build "$export_dir" --target auto --precision fp8
    step inspect 30 "$python" -m dlmrt.cli inspect "$DLMRT_HOME/engines"
    step generate-trt 60 "$python" -m dlmrt.cli generate --backend trt --model "$export_dir" --precision fp8 \
        --prompt "add:762+139=" --metrics
    precisions=bf16,fp8
fi
step bench-llada-8b 180 "$python" -m dlmrt.cli bench --model llada-8b --device cuda --dtype bfloat16 \
    --backend torch:eager,torch:cudagraph --input-len 512 --output-len 32 --num-iters 3 \
    --output-json "$results/bench_llada_8b.json"
step bench-diffusion-gemma 120 "$python" -m dlmrt.cli bench --model dlmrt/assets/tiny-diffusion-gemma --device cuda \
    --policy entropy_bound --backend torch:eager,torch:cudagraph --batch-size 4 --input-len 12 --output-len 32 \
    --block-length 16 --output-json "$results/bench_diffusion_gemma.json"
step backends 120 "$python" scripts/bench_backends.py --export "$export_dir" --precisions "$precisions" \
    --json "$results/backends.json"

"$python" - "$results/gpu_tests.xml" "$steps" <<'PY'
import sys
import xml.etree.ElementTree as ET
from rich.console import Console
from rich.table import Table

table = Table(title="GPU and TensorRT checks")
for column in ("check", "result", "seconds"):
    table.add_column(column)
for case in ET.parse(sys.argv[1]).iter("testcase"):
    outcome = "passed"
    for child in case:
        if child.tag in ("failure", "error"):
            outcome = child.tag
        elif child.tag == "skipped":
            outcome = "skipped: " + (child.get("message") or "")[:70]
    table.add_row(f"{case.get('classname').split('.')[-1]}::{case.get('name')}", outcome,
                  f"{float(case.get('time', 0)):.1f}")
for line in open(sys.argv[2]):
    name, outcome, seconds = line.rstrip("\n").split("\t")
    table.add_row(f"dlmrt {name} (tiny model)", outcome, seconds)
Console(width=140).print(table)
PY
for log in latency-eager-cudagraph latency-compile bench-llada-8b bench-diffusion-gemma backends; do  # the benchmark's own tables
    [ -f "$results/$log.log" ] && grep -v "^  " "$results/$log.log" | tail -n 30
done
