"""The ``luban`` command line: one entry point, one sub-command per user action.

Each sub-package contributes its sub-commands through a ``register(subparsers)`` function in
its own ``cli`` module; handlers import heavy dependencies (torch) lazily so that
``luban --help`` stays fast. A ``LubanError`` becomes one line on stderr and exit code 2.
"""

from __future__ import annotations

import argparse
import importlib
import sys

from luban.errors import LubanError

SUBCOMMAND_MODULES = [
    "luban.train.cli",
    "luban.cluster.cli",
    "luban.data.cli",
    "luban.plan.cli",
]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="luban", description="Train language models with composable parallelism, "
                                     "plan their layouts, and time-share the cluster that runs them.")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name in SUBCOMMAND_MODULES:
        importlib.import_module(name).register(sub)
    return parser


def early_signals(argv: list[str]) -> None:
    """``train``/``demo``: install the suspend handlers before any slow import (luban.train.preempt)."""
    if argv[:1] not in (["train"], ["demo"]):
        return
    from luban.train import preempt

    preempt.install()


def main(argv: list[str] | None = None) -> int:
    if argv is None:  # a real process entry (in-process callers keep their own signal handling)
        early_signals(sys.argv[1:])
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return int(args.func(args) or 0)
    except LubanError as err:
        print(f"luban: error: {err}", file=sys.stderr)
        return err.exit_code


if __name__ == "__main__":
    sys.exit(main())
