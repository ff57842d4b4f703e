"""The TensorRT builder, kept thin: parse one ONNX graph, set the plan's profile and options, build.

TensorRT 10.x takes the precision as builder flags; 11.x removed them and builds every network
strongly typed, with the precision in the graph (casts, Q/DQ). Which one applies is decided by the
plan from the installed version. Nothing here runs without TensorRT, so the tests that cover it
carry the `trt` marker; everything it is given (plans, profiles, quantized graphs) is tested on the CPU.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

from dlmrt.engines.plan import BuildPlan, GraphPlan
from dlmrt.core.errors import DlmrtError
from dlmrt.ops import register_tensorrt_plugins


class BuildError(DlmrtError):
    """TensorRT could not parse the graph or build the engine."""


def installed_tensorrt() -> str | None:
    """The installed TensorRT's version, or None where it is not installed."""
    if importlib.util.find_spec("tensorrt") is None:
        return None
    import tensorrt

    return tensorrt.__version__


def require_tensorrt():
    if installed_tensorrt() is None:
        raise BuildError("building an engine needs TensorRT, which is not installed: pip install "
                         "'dlmrt[tensorrt]' on a machine with an NVIDIA GPU (or plan with --dry-run)")
    import tensorrt

    return tensorrt


def build_graph(plan: BuildPlan, graph: GraphPlan, onnx_path: Path,
                timing_cache: bytes | None) -> tuple[bytes, bytes]:
    """Build `graph` (read from `onnx_path`) as the plan says; returns (engine, updated timing cache)."""
    trt = require_tensorrt()
    register_tensorrt_plugins()  # before parsing: the parser maps the graphs' dlmrt nodes to them
    logger = trt.Logger(trt.Logger.WARNING)
    builder = trt.Builder(logger)
    strongly_typed = plan.typing == "strongly-typed"
    flags = 1 << int(trt.NetworkDefinitionCreationFlag.STRONGLY_TYPED) if strongly_typed else 0
    network = builder.create_network(flags)
    parser = trt.OnnxParser(network, logger)
    if not parser.parse_from_file(str(onnx_path)):
        errors = "; ".join(str(parser.get_error(i)) for i in range(parser.num_errors))
        raise BuildError(f"TensorRT {trt.__version__} could not parse {onnx_path.name}: {errors}")
    config = builder.create_builder_config()
    config.set_memory_pool_limit(trt.MemoryPoolType.WORKSPACE, plan.options.workspace_bytes)
    config.builder_optimization_level = plan.options.optimization_level
    for flag in plan.builder_flags:
        config.set_flag(getattr(trt.BuilderFlag, flag))
    cache = config.create_timing_cache(timing_cache or b"")
    config.set_timing_cache(cache, ignore_mismatch=False)
    profile = builder.create_optimization_profile()
    for name, (low, opt, high) in graph.shapes.items():
        profile.set_shape(name, low, opt, high)
    config.add_optimization_profile(profile)
    engine = builder.build_serialized_network(network, config)
    if engine is None:
        raise BuildError(f"TensorRT {trt.__version__} failed to build {graph.name} for {plan.target} "
                         f"{plan.precision} (its log above says why)")
    return bytes(engine), bytes(config.get_timing_cache().serialize())
