"""`dlmrt eval`: exact-match and tokens per forward of decoding settings over the tasks."""
