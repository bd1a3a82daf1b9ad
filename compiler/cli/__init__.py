"""The `kiln` command."""

from kiln.cli.commands import main

__all__ = ["main"]
