"""The `tandem` command line (`python -m tandem.cli` alike)."""

from tandem.cli.commands import main

__all__ = ["main"]
