"""`ParallelPlan`: how a model is split over ranks (`--tp`, `--ep`), checked before any rank starts.

    plan = ParallelPlan(tp=2, ep=2)
    plan.check(model, backend="torch")     # one ArgumentError naming what does not fit, and what would
    plan.apply(model, ranks)               # in each rank: experts, then tensors

All ranks form one group of `world = max(tp, ep)` processes: tensor parallelism splits every layer
over all of them (tp = world), expert parallelism splits the experts over all of them (ep = world).
With tp = 1 and ep > 1 the ranks run attention and the dense layers whole, and split only the
experts; with tp > 1 and ep = 1 every expert is split like an MLP.
"""

from __future__ import annotations

from dataclasses import dataclass

from dlmrt.core.errors import ArgumentError

# The backends with a parallel path: ONNX Runtime and TensorRT run one exported graph per process.
PARALLEL_BACKENDS = ("torch",)


@dataclass(frozen=True)
class ParallelPlan:
    tp: int = 1
    ep: int = 1

    @property
    def world(self) -> int:
        return max(self.tp, self.ep)

    @property
    def parallel(self) -> bool:
        return self.world > 1

    def check_backend(self, backend: str) -> None:
        """Raise one ArgumentError if `backend` cannot run this plan."""
        if self.parallel and backend not in PARALLEL_BACKENDS:
            raise ArgumentError(f"--backend {backend} has no tensor- or expert-parallel path (an ONNX Runtime session "
                                f"or a TensorRT engine runs the whole graph in one process): use --backend torch "
                                f"with --tp/--ep, or drop them")

    def check(self, model) -> None:
        """Raise one ArgumentError if this plan cannot split `model` (its module tree: the meta device will
        do)."""
        for flag, value in (("--tp", self.tp), ("--ep", self.ep)):
            if value < 1:
                raise ArgumentError(f"{flag} must be at least 1, got {value}")
        if 1 < self.tp != self.ep > 1:
            raise ArgumentError(f"--tp {self.tp} and --ep {self.ep}: the ranks form one group, so with both above 1 "
                                f"they must be equal (or give one of them alone)")
        if self.tp > 1:
            from dlmrt.parallel.tensor_parallel import check_tensor_split

            check_tensor_split(model, self.tp, split_experts=self.ep == 1)
        if self.ep > 1:
            from dlmrt.parallel.experts import check_expert_split

            check_expert_split(model, self.ep)

    def apply(self, model, ranks):
        """`model` cut in place into this rank's part."""
        if self.ep > 1:
            from dlmrt.parallel.experts import shard_experts

            shard_experts(model, ranks)
        if self.tp > 1:
            from dlmrt.parallel.tensor_parallel import shard_model

            shard_model(model, ranks)
        return model
