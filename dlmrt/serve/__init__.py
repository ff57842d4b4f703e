"""`dlmrt serve`'s application: the OpenAI-compatible API over the runtime's scheduler, its request schema and
its Prometheus metrics."""
