"""The package's version, for the manifests that record which dlmrt wrote them."""

__version__ = "0.1.0"
