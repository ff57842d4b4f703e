"""Running one model across several processes: tensor and expert parallelism on torch.distributed.

    ranks.py            a rank's process group and the collectives it issues (counted on request)
    launch.py           starting the ranks (or joining torchrun's), and ending all of them on a failure
    plan.py             ParallelPlan(tp, ep): checked before any rank starts, applied in each rank
    tensor_parallel.py  the TP split of a loaded denoiser: heads, MLPs, experts, a vocabulary-parallel head
    experts.py          the EP split of a MoE's experts
    vocab.py            the step, the ORL residual and DiffusionGemma's step from a vocabulary slice
    lockstep.py         rank 0's batches replayed by the other ranks of a served model
    serving.py          serving a split model: rank 0 serves, the others follow (alone, torchrun's, a replica's)

Design notes: docs/parallelism.md.
"""
