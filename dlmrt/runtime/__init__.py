"""The step loop and what drives it: backends, decoding policies, KV cache, batching, metrics.

    from dlmrt.runtime import Generator, GenerationSettings, Threshold
    result = Generator(dlmrt.load()).generate(prompts, GenerationSettings(16, 8, Threshold(0.9)))

The reference loop (`dlmrt.runtime.reference`) is the plain oracle the Generator is tested against.
"""

import importlib

# Each name's module, imported on first use: so that the torch-free modules (`policy_registry`, which
# `dlmrt --help` reads) import without the rest.
_MODULE_OF = {
    **dict.fromkeys(("BlockUpdate", "GenerationResult", "GenerationStream", "Generator", "RowOutput"), "generator"),
    "GenerationMetrics": "metrics",
    **dict.fromkeys(("Dream", "Factor", "Fixed", "LLaDA2", "LLaDA21", "MaskPolicy", "Policy", "ResidualPolicy",
                     "Threshold", "make_policy"), "policies"),
    "EntropyBound": "uniform_policy",
    "POLICIES": "policy_registry",
    **dict.fromkeys(("CACHE_MODES", "GenerationSettings"), "settings"),
}

__all__ = sorted(_MODULE_OF)


def __getattr__(name: str):
    if name not in _MODULE_OF:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f"{__name__}.{_MODULE_OF[name]}"), name)
    globals()[name] = value
    return value
