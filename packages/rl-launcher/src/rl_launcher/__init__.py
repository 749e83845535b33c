"""rl-launcher: see README.md for what this package holds."""

from importlib.metadata import PackageNotFoundError, version

try:
    __version__ = version("rl-launcher")
except PackageNotFoundError:
    __version__ = "0.0.0"
