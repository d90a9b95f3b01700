"""specdec: disaggregated speculative decoding (the core: models, verification, schedules; the services' shared
parts under specdec/server)."""
from importlib import metadata as _metadata

try:
    __version__ = _metadata.version("specdec")
except _metadata.PackageNotFoundError:  # run from a checkout that was never installed
    __version__ = "0+unknown"
