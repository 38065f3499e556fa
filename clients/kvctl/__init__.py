"""kvctl: the operators' admin CLI for a kvstore master (console script ``kvctl``).

``kvctl.main.main(argv) -> int`` is the entry point; :mod:`kvctl.commands` holds what
each subcommand asks the master, :mod:`kvctl.explain` the pure ``lookup`` explanation and
:mod:`kvctl.tables` the tables for people. Importing this package pulls in neither grpc,
rich, numpy nor torch.
"""

from __future__ import annotations

from kvctl.main import main

__all__ = ["main"]
