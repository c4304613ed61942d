"""The client against what is not a luban service, and against bad tokens and URLs: one line each,
exit 2, never a traceback (a hostile sweep, 2026-11-27: a web server answering 200 with HTML or
another API's JSON gave JSONDecodeError/KeyError/TypeError tracebacks from `luban jobs`, `luban
stop`...; a token holding a newline was printed back in an 'unreachable' message)."""

from __future__ import annotations

import httpx
import pytest

from luban.cluster.client import SERVICE_HEADER, Client
from luban.errors import LubanError


def answering(response: httpx.Response) -> Client:
    client = Client(url="http://10.0.0.1:80", token="x")
    client.http = httpx.Client(base_url=client.url, transport=httpx.MockTransport(lambda request: response))
    return client


@pytest.mark.parametrize("response", [
    httpx.Response(200, text="<html>hi</html>", headers={"content-type": "text/html"}),
    httpx.Response(200, json={"a": 1}),    # another API: luban's CLI would index it as a job
    httpx.Response(200, json=[1]),
    httpx.Response(200, text="<html>", headers={SERVICE_HEADER: "1"}),  # luban's mark, cut-off body
])
def test_an_answer_that_is_not_luban_s_is_one_line(response):
    with pytest.raises(LubanError, match=r"^GET /jobs .*is http://10\.0\.0\.1:80 a luban cluster service\?|"
                                         r"the answer is not JSON") as err:
        answering(response).call("GET", "/jobs")
    assert "\n" not in str(err.value)


def test_an_error_page_is_not_printed_whole():
    page = "<!DOCTYPE HTML><html><body>" + "x" * 5000 + "</body></html>"
    with pytest.raises(LubanError, match=r"^GET /jobs answered without a message: .* \(HTTP 404\)$"):
        answering(httpx.Response(404, text=page)).call("GET", "/jobs")


@pytest.mark.parametrize("token", ["sec\nret", "sëcret", "\x00"])
def test_a_token_luban_cannot_send_is_named_not_shown(token):
    with pytest.raises(LubanError) as err:
        Client(url="http://127.0.0.1:9", token=token)
    assert str(err.value).startswith("--token = '<hidden>': ") and "sec" not in str(err.value)


def test_a_port_out_of_range_is_the_url_s_fault():
    with pytest.raises(LubanError, match=r"^--url = 'http://127.0.0.1:99999': .*port 99999"):
        Client(url="http://127.0.0.1:99999", token="x")


def test_path_parts_are_quoted():
    seen = []
    client = Client(url="http://10.0.0.1:80", token="x")
    client.http = httpx.Client(base_url=client.url, transport=httpx.MockTransport(
        lambda request: seen.append(request.url.raw_path) or httpx.Response(
            200, json={"name": "n", "state": "up"}, headers={SERVICE_HEADER: "1"})))
    client.set_node("a/../b?c", "drain")
    assert seen == [b"/api/nodes/a%2F..%2Fb%3Fc"]


def test_a_command_that_is_not_a_job_name_still_submits(capsys, monkeypatch):
    """`luban submit -- './a b'` was refused for a name the user never gave ('a b'); the name made
    from the command is now a valid one (and the submission gets as far as the URL)."""
    from luban import cli

    monkeypatch.setattr(cli, "SUBCOMMAND_MODULES", ["luban.cluster.cli"])  # as tests/cluster/conftest.py's LUBAN
    assert cli.main(["submit", "--url", "http://127.0.0.1:9", "--token", "x", "--", "./a b ü"]) == 2
    err = capsys.readouterr().err
    assert "is unreachable" in err and "name" not in err, err


def test_a_job_file_that_is_a_named_pipe_is_refused_not_waited_on(tmp_path):
    """`luban submit job.yaml` waited forever on a named pipe (and read a link to /dev/zero until memory ran
    out): a hostile sweep, 2026-11-27. A child process, so that a hang fails at the timeout."""
    import os
    import subprocess

    from tests.cluster.conftest import LUBAN

    os.mkfifo(tmp_path / "job.yaml")
    (tmp_path / "zero.yaml").symlink_to("/dev/zero")
    for name in ("job.yaml", "zero.yaml"):
        proc = subprocess.run([*LUBAN, "submit", "--url", "http://127.0.0.1:9", "--token", "x", name],
                              cwd=tmp_path, capture_output=True, text=True, timeout=60)
        assert proc.returncode == 2 and proc.stderr == (f"luban: error: job file = '{name}': a regular file (this "
                                                        "is a named pipe, a device or a socket)\n"), proc.stderr


def test_a_foreign_server_s_control_codes_are_not_printed():
    """An error answer's message reached the terminal raw, escape sequences and all (a hostile sweep,
    2026-11-27: a web server answering HTTP 500 with {"detail": "\\x1b[31m..."})."""
    with pytest.raises(LubanError) as err:
        answering(httpx.Response(500, json={"detail": "bad \x1b[31mred\x07"})).call("GET", "/jobs")
    assert str(err.value) == "bad \\x1b[31mred\\x07 (HTTP 500)"
