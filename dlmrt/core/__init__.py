"""The bottom layer: errors, resource limits, atomic writes, JSON files, hashing, the dlmrt home, the tiny
tasks and chat templates. It imports nothing else of dlmrt."""
