"""Running one model across several processes: tensor and expert parallelism on torch.distributed.

    ranks.py           a rank's process group and the collectives it issues, counted
    launch.py          starting the ranks (or joining torchrun's), and ending all of them on a failure

Design notes: docs/parallelism.md.
"""
