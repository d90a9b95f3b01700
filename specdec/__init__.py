"""specdec: disaggregated speculative decoding. This package is the core: models and their KV slots, sampling and
verification, drafting and the pre-verifier, workers, schedules and the in-process engine. It imports torch, never
grpc, ray or a web framework (enforced by the import-linter contracts in pyproject.toml)."""
from importlib import metadata as _metadata

try:
    __version__ = _metadata.version("specdec")
except _metadata.PackageNotFoundError:  # run from a checkout that was never installed
    __version__ = "0+unknown"
