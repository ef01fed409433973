"""trainmesh: elastic 3D-parallel training of transformer models on Ray."""

from importlib.metadata import PackageNotFoundError, version

try:
    __version__ = version("trainmesh")
except PackageNotFoundError:  # imported from a source tree that was never installed
    __version__ = "0+unknown"
