"""The step loop and what drives it: backends, decoding policies, KV cache, batching, metrics.

    from dlmrt.runtime import Generator, GenerationSettings, Threshold
    result = Generator(dlmrt.load()).generate(prompts, GenerationSettings(16, 8, Threshold(0.9)))

The reference loop (`dlmrt.runtime.reference`) is the plain oracle the Generator is tested against.
"""

from dlmrt.runtime.generator import BlockUpdate, GenerationResult, GenerationStream, Generator, RowOutput
from dlmrt.runtime.metrics import GenerationMetrics
from dlmrt.runtime.policies import (POLICIES, Dream, EntropyBound, Factor, Fixed, LLaDA2, LLaDA21, Policy, Residual,
                                    Threshold, make_policy)
from dlmrt.runtime.settings import CACHE_MODES, GenerationSettings

__all__ = ["CACHE_MODES", "POLICIES", "BlockUpdate", "Dream", "EntropyBound", "Factor", "Fixed", "GenerationMetrics",
           "GenerationResult", "GenerationSettings", "GenerationStream", "Generator", "LLaDA2", "LLaDA21", "Policy",
           "Residual", "RowOutput", "Threshold", "make_policy"]
