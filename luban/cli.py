"""The ``luban`` command line: one entry point, one sub-command per user action.

Each sub-package contributes its sub-commands through a ``register(subparsers)`` function in
its own ``cli`` module; handlers import heavy dependencies (torch) lazily so that
``luban --help`` stays fast. A ``LubanError`` becomes one line on stderr and exit code 2; Ctrl-C
one line and 130, a closed stdout a quiet 141 (``luban.interrupt``).
"""

from __future__ import annotations

# the Ctrl-C recorder comes first, through the C module: ``import signal`` builds its enums in
# Python (~0.5 ms of bytecode) and a Ctrl-C landing there was a KeyboardInterrupt traceback
import _signal
import os
import sys


def _record_sigint(signum, frame) -> None:
    """Until ``main`` takes over: a Ctrl-C during the imports is recorded, then answered there."""
    global _EARLY_SIGINT
    _EARLY_SIGINT = True


_EARLY_SIGINT = False
if (os.path.basename(sys.argv[0]) == "luban"  # the console script, or python -m luban
        or getattr(getattr(sys.modules.get("__main__"), "__spec__", None), "name", None) == "luban.__main__"):
    if _signal.getsignal(_signal.SIGINT) is _signal.default_int_handler:  # an inherited SIG_IGN stays
        _signal.signal(_signal.SIGINT, _record_sigint)

import signal  # noqa: E402 - after the Ctrl-C recorder: the first moment luban can answer Ctrl-C
import argparse  # noqa: E402
import importlib  # noqa: E402
import re  # noqa: E402

from luban import interrupt, schema  # noqa: E402
from luban.errors import EXIT_INTERRUPTED, EXIT_SUSPENDED, LubanError, for_terminal

SUBCOMMAND_MODULES = [
    "luban.train.cli",
    "luban.cluster.cli",
    "luban.data.cli",
    "luban.plan.cli",
]


def error_line(what) -> str:
    """``luban: error: <what>`` as one line whatever a path or a name in it holds (line feeds shown as
    ``\\n``), and on a terminal with its control codes shown escaped (a file name or a model's name
    can hold ESC: a title, a clipboard write, a cleared screen)."""
    return for_terminal(f"luban: error: {what}", sys.stderr).replace("\n", "\\n")


class Parser(argparse.ArgumentParser):
    """argparse's usage errors as every other bad input: one line, exit 2 (argparse would print
    the whole usage first). A bad value reads ``luban: error: --key = 'value': <what is allowed>``,
    whether a ``luban.schema`` type refused it, it is not among the choices, or it is missing.
    Sub-parsers inherit the class."""

    def __init__(self, *args, **kwargs):
        # no abbreviations: `luban plan search --tp on` (search has no --tp) silently set --tp-overlap, and
        # `--tp 2` was refused as --tp-overlap = '2', a flag the user never typed (a review of 2026-12-04)
        kwargs.setdefault("allow_abbrev", False)
        super().__init__(*args, **kwargs)
        self._negative_number_matcher = schema.NEGATIVE_NUMBER  # no public setting: argparse asks this attribute

    def error(self, message: str):
        print(error_line(self.render(message)), file=sys.stderr)
        sys.exit(2)

    def parse_known_args(self, args=None, namespace=None):
        """A command (a parser without sub-commands) refuses what is not its own itself, named by its
        own usage, and before any value is read: argparse leaves unknown options to the top parser
        (``see: luban --help``), and ``luban sample --top-p 0.9`` first complained that CHECKPOINT
        ``'0.9'`` is no folder."""
        leaf = args is not None and not any(isinstance(a, argparse._SubParsersAction) for a in self._actions)
        if leaf:
            unknown = self._unknown_option(list(args))
            if unknown is not None:
                self.error(f"unrecognized arguments: {unknown}")
        namespace, extras = super().parse_known_args(args, namespace)
        if leaf and extras:
            self.error(f"unrecognized arguments: {' '.join(extras)}")
        return namespace, extras

    def _unknown_option(self, args: list[str]) -> str | None:
        """The first ``--name`` (or ``--name=value``) before ``--`` that names none of this command's
        options (nor, where abbreviations are allowed, begins one). A command that takes the rest of the
        line as it is (``luban submit -- COMMAND ...``) is left to argparse; a single-dash word is unknown
        when its first letter is no short option (``-n5``, ``-e KEY=V``: argparse's rules)."""
        if any(a.nargs == argparse.REMAINDER for a in self._actions):
            return None
        for arg in args:
            if arg == "--":
                return None
            if not arg.startswith("-") or arg == "-" or self._negative_number_matcher.match(arg):
                continue
            if not arg.startswith("--"):  # -x, or a cluster -n5 of a known -n (argparse's own rules)
                if arg[:2] not in self._option_string_actions:
                    return arg
                continue
            name = arg.split("=", 1)[0]
            if name not in self._option_string_actions and not (
                    self.allow_abbrev and any(option.startswith(name) for option in self._option_string_actions)):
                return arg
        return None

    def render(self, message: str) -> str:
        found = re.fullmatch(r"argument (?P<key>[^:]+): (?P<rest>.*)", message, re.DOTALL)
        if not found:
            command = self.prog.split(" ", 1)[1] if " " in self.prog else ""
            required = re.fullmatch(r"the following arguments are required: (?P<keys>.*)", message, re.DOTALL)
            unknown = re.fullmatch(r"unrecognized arguments: (?P<args>.*)", message, re.DOTALL)
            if required:  # the first one missing, as KEY = (missing)
                key, what = required["keys"].split(", ")[0], "required"
                message = f"{key} = (missing): {what}"
            elif unknown:
                first = unknown["args"].split(" ")[0]
                message = (f"{first.split('=', 1)[0]} = (unrecognized): not an option of this command"
                           if first.startswith("-") else f"{first} = (unrecognized): one argument more than this command takes")
            return f"{command + ': ' if command else ''}{message}  (see: {self.prog} --help)"
        names, rest = found["key"].split("/"), found["rest"]
        key = next((n for n in names if n.startswith("--")), names[-1])
        choice = re.fullmatch(r"invalid choice: (?P<value>.*) \(choose from (?P<choices>.*)\)", rest, re.DOTALL)
        if choice:
            return f"{key} = {choice['value']}: one of {choice['choices']}"
        if rest.startswith("expected "):  # the flag is there, its value is not
            action = next((a for a in self._actions if key in a.option_strings), None)
            return f"{key} = (missing): {getattr(getattr(action, 'type', None), 'allowed', 'a value')}"
        untyped = re.fullmatch(r"invalid (?P<type>\w+) value: (?P<value>.*)", rest, re.DOTALL)  # type=int, ...
        if untyped:
            return f"{key} = {untyped['value']}: {untyped['type']}"
        return f"{key} = {rest}"  # a luban.schema type's message: <value!r>: <allowed>


def build_parser() -> argparse.ArgumentParser:
    parser = Parser(prog="luban", description="Train language models with composable parallelism, "
                                     "plan their layouts, and time-share the cluster that runs them.")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name in SUBCOMMAND_MODULES:
        importlib.import_module(name).register(sub)
    return parser


def _suspends(argv: list[str]) -> bool:
    """``train``/``demo``: a signal suspends the run (``luban.train.preempt``) instead of interrupting it."""
    return argv[:1] in (["train"], ["demo"])


def early_signals(argv: list[str]) -> None:
    """``train``/``demo``: install the suspend handlers before any slow import (luban.train.preempt)."""
    if not _suspends(argv):
        return
    from luban.train import preempt

    preempt.install()
    if _EARLY_SIGINT:  # a Ctrl-C during the imports: recorded by preempt now, as one at start-up
        signal.raise_signal(signal.SIGINT)


def main(argv: list[str] | None = None) -> int:
    entry = argv is None  # a real process entry (in-process callers keep their own signal handling)
    if not entry:
        return _run(argv, entry)
    training = _suspends(sys.argv[1:])
    try:
        if not training:  # train/demo: Ctrl-C suspends (luban.train.preempt); the rest: luban.interrupt
            interrupt.install(_EARLY_SIGINT)
        code = _run(argv, entry)
        sys.stdout.flush()  # a closed pipe shows here, not in the interpreter's last flush
        interrupt.finished(code)
    except KeyboardInterrupt:
        interrupt.announce()
        interrupt.leave(EXIT_INTERRUPTED)  # no interpreter teardown: seconds once torch is loaded
    except BrokenPipeError:  # `luban jobs | head -1`: the reader is gone, and so is the output
        interrupt.quiet()
        code = interrupt.EXIT_PIPE
    interrupt.finished(code)
    return code


def _run(argv: list[str] | None, entry: bool) -> int:
    if entry:
        early_signals(sys.argv[1:])
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as done:  # --help, or a usage error Parser.error has printed
        if entry and _suspends(sys.argv[1:]):  # its code is decided: as at the end of a run, below
            from luban.train import preempt

            preempt.settle()
        return int(done.code or 0)
    training = entry and args.command in ("train", "demo")
    try:
        code = int(args.func(args) or 0)
    except LubanError as err:
        if not (err.everywhere and os.environ.get("RANK", "0") != "0"):  # one line for the job, not one per rank
            print(error_line(err), file=sys.stderr)
        code = err.exit_code
    except Exception as err:  # noqa: BLE001 - a rank of luban's launcher whose peer died: one line
        from luban import procs
        from luban.parallel.launch import peer_lost

        if not (training and os.environ.get(procs.PARENT_VAR) and peer_lost(err)):
            raise
        from luban.train import preempt

        if preempt.suspended_in_start_up():  # the peer's start-up grace ended first: it exited 75, as this one
            code = EXIT_SUSPENDED
        else:
            # this node's launcher names the rank that stopped (or that rank its own error); a peer on
            # another node is named only there, so here one line says what this rank saw
            if os.environ.get("WORLD_SIZE") != os.environ.get("LOCAL_WORLD_SIZE"):
                print(f"luban: error: rank {os.environ.get('RANK', '?')} lost a peer rank on another node "
                      f"({str(err).splitlines()[0][:160]}); that node's launcher says why", file=sys.stderr)
            code = 1
    finally:
        if training:
            from luban.train import preempt

            preempt.settle()
    if training:
        preempt.leave(code)  # does not return once torch is loaded (see preempt.leave)
    return code


if __name__ == "__main__":
    sys.exit(main())
