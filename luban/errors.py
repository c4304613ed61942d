"""User-facing errors and the process exit codes luban documents.

A ``LubanError`` is printed by the CLI as one line (``luban: error: ...``) with no traceback
and exit code ``EXIT_USAGE``. Messages name the offending key, the value and what is allowed.

Exit codes (also in docs/training.md):
  0   success
  1   unexpected crash (a bug: traceback printed)
  2   bad input: config, flags, data (``EXIT_USAGE``)
  74  a checkpoint, a dataset or an export could not be written (disk full, read-only,
      permission): the previous checkpoint or dataset is intact; free space or fix the folder
      and resume or run again (``EXIT_CHECKPOINT``; 74 is EX_IOERR from sysexits.h)
  75  suspended on request (SIGUSR1/SIGTERM): a checkpoint was saved, resume me
      (``EXIT_SUSPENDED``; 75 is EX_TEMPFAIL from sysexits.h)
  130 interrupted twice with SIGINT: exited at once without saving
"""

EXIT_USAGE = 2
EXIT_CHECKPOINT = 74
EXIT_SUSPENDED = 75
EXIT_INTERRUPTED = 130


class LubanError(Exception):
    """An error caused by the user's input; shown as one line, exit code 2."""

    exit_code = EXIT_USAGE


def unknown_key(section: str, key, value, known) -> LubanError:
    """A key a table does not have, as ``<section>.<key> = <value>: unknown key; allowed: ...``
    (a key that is not a plain name is quoted: one line whatever it holds)."""
    name = f"{section}.{key}" if plain_name(key) else f"{section}[{key!r}]"
    return bad_value(name, value, f"unknown key; allowed: {', '.join(known)}")


def plain_name(key) -> bool:
    """Whether a key can be printed as is in a one-line message (else it is quoted with repr)."""
    return isinstance(key, str) and key != "" and key.isprintable() and key.strip() == key


SHOWN_CHARS = 200  # a bad value is shown (repr) up to this many characters: a long path whole, a megabyte not


def shown(value, limit: int = SHOWN_CHARS) -> str:
    """``repr(value)``, cut to ``limit`` characters: one short line whatever the value holds."""
    text = repr(value)
    return text if len(text) <= limit else text[:limit] + "..."


def escaped(text: str, keep: str = "") -> str:
    """``text`` with every non-printable character but those in ``keep`` written as its escape (ESC as
    ``\\x1b``, U+202E as ``\\u202e``): text that another user, a foreign server or a model wrote cannot
    drive the terminal it is printed on (set its title, write its clipboard, reorder what it shows)."""
    return "".join(c if c.isprintable() or c in keep else ascii(c)[1:-1] for c in text)


def for_terminal(text: str, stream, keep: str = "\n\t\r") -> str:
    """``text`` as ``escaped`` where ``stream`` is a terminal, as is where it is a file or a pipe
    (whose reader asked for the bytes as written)."""
    isatty = getattr(stream, "isatty", None)
    return escaped(text, keep) if isatty is not None and isatty() else text


def bad_value(key: str, value, allowed: str) -> LubanError:
    """The standard message: ``<key> = <value>: <what is allowed>``."""
    return LubanError(f"{key} = {shown(value)}: {allowed}")


class OutputWriteError(LubanError):
    """Writing luban's output (a dataset, a Hugging Face export) failed on the storage side;
    what was there before is kept."""

    exit_code = EXIT_CHECKPOINT


class CheckpointWriteError(OutputWriteError):
    """Saving a checkpoint failed on the storage side; the previous checkpoint is kept."""
