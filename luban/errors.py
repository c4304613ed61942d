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

import re
import unicodedata


EXIT_USAGE = 2
EXIT_CHECKPOINT = 74
EXIT_SUSPENDED = 75
EXIT_INTERRUPTED = 130


class LubanError(Exception):
    """An error caused by the user's input; shown as one line, exit code 2. ``everywhere``: raised
    alike on every rank of a job (a collective check's answer), so rank 0 alone prints it."""

    exit_code = EXIT_USAGE
    everywhere = False


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


# scheme://USER:PASSWORD@ -- the userinfo a URL may carry (RFC 3986 3.2.1); the last "@" before the path ends it.
# A password typed unencoded with "/", "?" or "#" in it runs to the next "@" (SQLAlchemy reads
# postgresql://alice:pa/ss@db/x so; httpx fails on "pa" as a port) unless what follows the ":" is a port
# (http://host:8765/p?mail=a@b holds none). An IPv6 host's "[" is no user.
_USERINFO = re.compile(r"^(\s*[A-Za-z][A-Za-z0-9+.-]*://[^/?#@:\[\]]*):(?:[^/?#]*@|(?![0-9]*(?:[/?#]|$))[^@]*@)")
# ...?password=PASSWORD: libpq's own parameter, which SQLAlchemy passes to the driver from --db's query
_QUERY_PASSWORD = re.compile(r"([?&]password=)[^&#]*", re.IGNORECASE)


def without_password(url: str) -> str:
    """``url`` as luban prints it: a password in it reads PASSWORD (as a token reads TOKEN), so an error
    line, or the retry command a user pastes into a ticket, gives no secret away (the cluster's --url,
    $LUBAN_CLUSTER_URL, --db)."""
    if not isinstance(url, str):
        return url
    return _QUERY_PASSWORD.sub(r"\1PASSWORD", _USERINFO.sub(r"\1:PASSWORD@", url))


def escaped(text: str, keep: str = "") -> str:
    """``text`` with every control character (``_drives``) but those in ``keep`` written as its escape (ESC as
    ``\\x1b``, U+202E as ``\\u202e``): text that another user, a foreign server or a model wrote cannot
    drive the terminal it is printed on (set its title, write its clipboard, reorder what it shows).
    Text stays as written: spaces (U+3000 between CJK words, a no-break space) and the joiners of
    emoji sequences are not controls."""
    return "".join(c if c in keep or not _drives(c) else ascii(c)[1:-1] for c in text)


# the bidirectional formatting characters (reorder what a terminal shows: a filename that reads backwards)
_BIDI = frozenset("\u061c\u200e\u200f\u202a\u202b\u202c\u202d\u202e\u2066\u2067\u2068\u2069")


def _drives(c: str) -> bool:
    """A character a terminal acts on rather than shows: C0/C1 controls and DEL (ESC, CSI U+009B,
    NEL U+0085), a lone surrogate, a line or paragraph separator, a bidirectional override."""
    return unicodedata.category(c) in ("Cc", "Cs", "Zl", "Zp") or c in _BIDI


def for_terminal(text: str, stream) -> str:
    """``text`` as ``escaped`` where ``stream`` is a terminal, as is where it is a file or a pipe
    (whose reader asked for the bytes as written). Line feeds and tabs are kept; a carriage return
    only where it ends a line: alone it sends the cursor back over what was just printed, so a job
    could hide a line of its log under another."""
    return escaped(text.replace("\r\n", "\n"), TERMINAL_KEEP) if _isatty(stream) else text


TERMINAL_KEEP = "\n\t"  # the controls a terminal is left to act on: they lay text out, they do not hide it


def for_terminal_chunks(chunks, stream):
    """``for_terminal`` of a text read in chunks (a log followed as it grows): a carriage return that
    ends a chunk is held until the next one says whether a line feed follows it."""
    if not _isatty(stream):
        yield from chunks
        return
    held = ""
    for chunk in chunks:
        text = held + chunk
        held = "\r" if text.endswith("\r") else ""
        yield for_terminal(text[:len(text) - len(held)], stream)
    if held:
        yield for_terminal(held, stream)


def _isatty(stream) -> bool:
    isatty = getattr(stream, "isatty", None)
    return isatty is not None and isatty()


def bad_value(key: str, value, allowed: str) -> LubanError:
    """The standard message: ``<key> = <value>: <what is allowed>``."""
    return LubanError(f"{key} = {shown(value)}: {allowed}")


class OutputWriteError(LubanError):
    """Writing luban's output (a dataset, a Hugging Face export) failed on the storage side;
    what was there before is kept."""

    exit_code = EXIT_CHECKPOINT


class CheckpointWriteError(OutputWriteError):
    """Saving a checkpoint failed on the storage side; the previous checkpoint is kept."""
