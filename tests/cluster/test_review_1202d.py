"""What the review of session 26's changes found (2026-12-02, 1202d).

- ``errors.without_password`` took a password to end at the first "/", "?" or "#": one typed
  unencoded with such a character (``postgresql://alice:pa/ss@db/x``, which SQLAlchemy reads as the
  password ``pa/ss``) was printed whole, where ``serve --db``'s error had hidden it before (SQLAlchemy's
  own ``render_as_string(hide_password=True)``). ``--url`` too, in its error line, which also quoted
  httpx's reason ("Invalid port: 's3cr'": the password's first characters).
- The retry command a 503 prints (``cd DIR && luban submit --key K ...``) was refused (409) when pasted
  into the very shell it names: ``cd`` moves $OLDPWD (and, into a directory reached through a symbolic
  link, $PWD to the resolved path), which ``--export ALL`` sends, so the repeat's spec differed.
"""

from __future__ import annotations

import argparse
import os
import subprocess

import pytest

from luban.cluster import cli
from luban.cluster.client import Client
from luban.errors import LubanError, without_password


@pytest.mark.parametrize("url, shown", [
    ("postgresql://alice:pa/ss@db/x", "postgresql://alice:PASSWORD@db/x"),  # SQLAlchemy: password "pa/ss"
    ("http://alice:s3cr#t@host:8765", "http://alice:PASSWORD@host:8765"),
    ("http://alice:s3?t@host", "http://alice:PASSWORD@host"),
    ("postgresql://alice:pa/ss@db:5432/x?opt=a@b", "postgresql://alice:PASSWORD@db:5432/x?opt=a@b"),
    # a port, then "@" in the path, query or fragment: no password there
    ("http://host:8765/p?mail=a@b", "http://host:8765/p?mail=a@b"),
    ("http://host:8765#x@y", "http://host:8765#x@y"),
    ("http://host:/a@b", "http://host:/a@b"),
    ("http://[::1]:8765/a@b", "http://[::1]:8765/a@b"),
    ("http://alice:pw@[::1]:8765", "http://alice:PASSWORD@[::1]:8765"),
])
def test_a_password_with_a_slash_question_mark_or_hash_is_hidden_too(url, shown):
    assert without_password(url) == shown


def test_serve_db_with_a_slash_in_its_password_is_shown_without_it():
    """What SQLAlchemy takes as the password is what the error hides (port 9: refused at once)."""
    from luban.cluster import db

    with pytest.raises(LubanError) as err:
        db.open_checked("postgresql://alice:s3/cret@127.0.0.1:9/x")
    assert "s3/cret" not in str(err.value) and "alice:PASSWORD@127.0.0.1:9/x" in str(err.value), err.value


def test_a_url_httpx_cannot_parse_for_its_password_shows_none_of_it():
    """httpx reads ``alice:s3cr`` as HOST:PORT ("Invalid port: 's3cr'"): neither the URL nor the
    reason shows the password."""
    with pytest.raises(LubanError) as err:
        Client("http://alice:s3cr#t@host:8765", "token")
    assert "s3cr" not in str(err.value) and "alice:PASSWORD@host:8765" in str(err.value), err.value


def test_a_url_flag_that_is_no_text_is_shown_without_its_password():
    """An undecodable byte (a lone surrogate in argv) in the password: the flag's error hides it."""
    parser = argparse.ArgumentParser()
    cli.register(parser.add_subparsers())
    parse = next(a.type for a in parser._subparsers._group_actions[0].choices["submit"]._actions
                 if "--url" in a.option_strings)
    with pytest.raises(argparse.ArgumentTypeError) as err:
        parse("http://alice:s3cr\udcffet@host")
    assert "s3cr" not in str(err.value) and "alice:PASSWORD@host" in str(err.value), err.value


@pytest.mark.parametrize("through_link", [False, True], ids=["directory", "symlink"])
def test_the_retry_command_pasted_into_the_same_shell_repeats_the_submission(through_link, in_process, tmp_path,
                                                                             monkeypatch, capsys):
    """The user submitted (--export ALL, the default) from DIR, having come from /usr; the answer was
    lost; the command printed, run in that shell, is answered with the job made, not a 409."""
    real = tmp_path / "real"
    real.mkdir()
    here = tmp_path / "link" if through_link else real
    if through_link:
        here.symlink_to(real)
    service = in_process(state=tmp_path / "state")
    token = service.user("alice", 1)
    client = Client("http://testserver", token)
    client.http = service.http
    service.http.headers["Authorization"] = f"Bearer {token}"
    monkeypatch.setattr(cli, "_client", lambda args: client)
    monkeypatch.delenv("LUBAN_CLUSTER_URL", raising=False)
    monkeypatch.chdir(here)
    monkeypatch.setenv("PWD", str(here))  # what the shell says, as bash sets it after `cd DIR`
    monkeypatch.setenv("OLDPWD", "/usr")
    parser = argparse.ArgumentParser()
    cli.register(parser.add_subparsers())
    argv = ["submit", "--key", "k-1202d", "--name", "a", "--", "true"]
    cli.cmd_submit(parser.parse_args(argv))  # made (its answer, say, lost on the way)
    assert capsys.readouterr().out.startswith("submitted job "), "the first submission"
    command = cli._submit_again(parser.parse_args(argv), "k-1202d")  # what the 503's line ends with

    run = "luban() { printf '%s\\0' \"$PWD\" \"$OLDPWD\" \"$@\"; }; " + command
    out = subprocess.run(["bash", "-c", run], capture_output=True, cwd=here, timeout=30, check=True,
                         env={**os.environ, "PWD": str(here), "OLDPWD": "/usr"}).stdout
    pwd, oldpwd, *words = out.decode().split("\0")[:-1]
    monkeypatch.chdir(pwd)
    monkeypatch.setenv("PWD", pwd)
    monkeypatch.setenv("OLDPWD", oldpwd)
    cli.cmd_submit(parser.parse_args(words))
    assert capsys.readouterr().out.endswith("was submitted with --key k-1202d before (it is queued); "
                                            "nothing new submitted\n")


@pytest.mark.parametrize("url, shown", [
    ("postgresql://alice@db/x?password=s3cret", "postgresql://alice@db/x?password=PASSWORD"),
    ("postgresql://alice@db/x?sslmode=require&PASSWORD=s3cret&connect_timeout=3",
     "postgresql://alice@db/x?sslmode=require&PASSWORD=PASSWORD&connect_timeout=3"),
])
def test_a_password_in_the_query_is_hidden_too(url, shown):
    """libpq's ``password`` parameter: SQLAlchemy hands --db's query to the driver."""
    assert without_password(url) == shown


@pytest.mark.parametrize("url", ["http://alice:s3cret@127.0.0.1:9", "http://alice@127.0.0.1:9"])
def test_a_url_with_credentials_is_refused_before_it_loses_the_token(url):
    """httpx sends a URL's user[:password] as Basic auth in place of the bearer token: every call was a
    401 ("missing or invalid bearer token"). The client refuses such a URL in one line, password hidden."""
    with pytest.raises(LubanError) as err:
        Client(url, "token")
    assert "s3cret" not in str(err.value) and "no user:password@" in str(err.value), err.value
    assert str(err.value).startswith(f"--url = '{without_password(url)}'"), err.value


def test_a_public_url_with_credentials_is_refused(tmp_path):
    import sys

    proc = subprocess.run([sys.executable, "-m", "luban", "cluster", "serve", "--state", str(tmp_path / "s"),
                           "--public-url", "http://alice:s3cret@head:8765"], capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 2 and "s3cret" not in proc.stderr and "no user:password@" in proc.stderr, proc.stderr
