"""scripts/bench_backends.py (the backends table of scripts/gpu_check.sh), run on its CPU cases: the float ones give
torch eager's tokens, the CPU-quantized exports their agreement."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

pytest.importorskip("onnxruntime")

SCRIPT = Path(__file__).parents[2] / "scripts" / "bench_backends.py"


def test_every_cpu_backend_gives_torch_eagers_tokens_and_a_latency(tiny_export, tmp_path):
    spec = importlib.util.spec_from_file_location("bench_backends", SCRIPT)
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    found = tmp_path / "backends.json"
    assert script.main(["--device", "cpu", "--repeats", "1", "--batch", "3", "--export", str(tiny_export),
                        "--json", str(found)]) == 0
    rows = {row["setting"]: row for row in json.loads(found.read_text())["cases"]}
    floats = ["torch eager", "torch compile", "onnxruntime cpu"]
    assert list(rows) == [*floats, "onnxruntime cpu int8", "onnxruntime cpu int4", "onnxruntime cpu int8-dynamic"]
    assert all(rows[name]["same_tokens"] and rows[name]["token_agreement"] == 1.0 for name in floats)
    assert all(row["ms_per_step"] > 0 and 0 < row["token_agreement"] <= 1 for row in rows.values())
