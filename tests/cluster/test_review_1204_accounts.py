"""Review 2026-12-04: per-user OS accounts and group directories (a hostile review against a root
``luban cluster serve``: jobs run as accounts luban-NAME, groups are Unix groups luban-g-NAME).

1. ``admin user set NAME --no-group`` / ``--group OTHER`` left the account in the old group's Unix
   group (``usermod --append`` only): its jobs still read and wrote the old group's data directory.
2. User ``g-X`` and group ``X`` were one Unix group: ``user add g-rcteam`` made luban-g-rcteam (and
   its primary group of that name); ``group add rcteam --data-dir D`` adopted that group, so user
   g-rcteam, no member, read and wrote D.
3. ``group add --data-dir LINK`` followed the link: a link to a root-only directory made that
   directory root:luban-g-X 2770.
4. /docs, /redoc and /openapi.json answered without a token (/docs loading Swagger UI from a CDN).
5. ``luban submit FILE.yaml`` expanded YAML aliases on the client (the service refuses them): a
   600-byte alias bomb took 11 s and 600 MB to print its error.

The API runs in this process (``in_process``); accounts and groups made here hold a random tag in
their names and are removed afterwards (the root cases: 1-3)."""

from __future__ import annotations

import grp
import os
import pwd
import secrets
import stat
import subprocess

import pytest

from luban.cluster import accounts
from luban.errors import LubanError

root_only = pytest.mark.skipif(os.geteuid() != 0, reason="per-user OS accounts need the service to run as root")


def sh(*argv: str) -> None:
    subprocess.run(argv, check=True, capture_output=True, timeout=120)


@pytest.fixture
def root_api(in_process, tmp_path):
    """(the API of a service running jobs as per-user accounts, a tag): every OS account and group
    whose name holds the tag is removed afterwards, even when the test fails."""
    tag = "rv" + secrets.token_hex(3)
    api = in_process(run_jobs_as="user", state=tmp_path / "state")  # (a data dir in tmp_path: not in the state)
    yield api, tag
    for entry in pwd.getpwall():
        if tag in entry.pw_name:
            subprocess.run(["userdel", "--remove", entry.pw_name], capture_output=True, timeout=120)
    for entry in grp.getgrall():
        if tag in entry.gr_name:
            subprocess.run(["groupdel", entry.gr_name], capture_output=True, timeout=120)


def luban_groups(account: str) -> list[str]:
    return sorted(g.gr_name for g in grp.getgrall()
                  if g.gr_name.startswith(accounts.GROUP_PREFIX) and account in g.gr_mem)


def post(api, path: str, body: dict):
    return api.http.post("/api" + path, json=body, headers=api.admin)


def move(api, name: str, group: str | None) -> None:
    r = api.http.patch(f"/api/users/{name}", json={"group": group}, headers=api.admin)
    assert r.status_code == 200, r.text


# -- 1 ---------------------------------------------------------------------------------------------
@root_only
def test_a_user_moved_to_another_group_or_out_of_any_leaves_the_old_unix_group(root_api):
    api, tag = root_api
    a, b = f"{tag}a", f"{tag}b"
    for group in (a, b):
        assert post(api, "/groups", {"name": group}).status_code == 201
    api.user(f"{tag}u", group=a)
    account = accounts.account_for(f"{tag}u")
    assert luban_groups(account) == [accounts.unix_group(a)]
    move(api, f"{tag}u", b)
    assert luban_groups(account) == [accounts.unix_group(b)]
    move(api, f"{tag}u", None)
    assert luban_groups(account) == []
    assert os.getgrouplist(account, pwd.getpwnam(account).pw_gid) == [pwd.getpwnam(account).pw_gid]


@root_only
def test_a_mapped_account_keeps_its_own_groups_and_another_mapped_users_group(root_api):
    """--os-user: an existing account, in a group of its own (not luban's) and, left over, in a luban
    group its new user is not in; a second user mapped to the same account keeps that one's group."""
    api, tag = root_api
    a, b = f"{tag}a", f"{tag}b"
    for group in (a, b):
        assert post(api, "/groups", {"name": group}).status_code == 201
    mapped, own = f"{tag}m", f"{tag}own"
    sh("groupadd", own)
    sh("useradd", "--user-group", "--no-create-home", "--shell", "/bin/sh", mapped)
    sh("usermod", "--append", "--groups", f"{own},{accounts.unix_group(b)}", mapped)
    assert post(api, "/users", {"name": f"{tag}v", "os_user": mapped, "group": a}).status_code == 201
    assert luban_groups(mapped) == [accounts.unix_group(a)] and mapped in grp.getgrnam(own).gr_mem
    move(api, f"{tag}v", None)
    assert luban_groups(mapped) == [] and mapped in grp.getgrnam(own).gr_mem
    assert post(api, "/users", {"name": f"{tag}w", "os_user": mapped, "group": b}).status_code == 201
    move(api, f"{tag}v", a)
    assert luban_groups(mapped) == [accounts.unix_group(a), accounts.unix_group(b)]
    move(api, f"{tag}v", None)  # w (group b) runs as the account too
    assert luban_groups(mapped) == [accounts.unix_group(b)] and mapped in grp.getgrnam(own).gr_mem


# -- 2 ---------------------------------------------------------------------------------------------
def test_a_user_name_that_is_a_group_s_account_is_refused():
    with pytest.raises(LubanError, match=r"^name = 'g-rcteam': a name not starting with 'g-' .*"
                                         r"luban-g-rcteam is the Unix group of a luban group 'rcteam'"):
        accounts.account_for("g-rcteam")
    assert accounts.account_for("rcteam") == "luban-rcteam"


@root_only
def test_user_g_x_is_refused_by_the_api_and_the_cli(root_api, monkeypatch, capsys):
    from fastapi.testclient import TestClient

    from luban import cli
    from luban.cluster import cli as cluster_cli
    from luban.cluster.client import Client

    api, tag = root_api
    r = post(api, "/users", {"name": f"g-{tag}"})
    assert r.status_code == 422 and r.json()["detail"].startswith(f"name = 'g-{tag}': a name not starting with 'g-'")
    with pytest.raises(KeyError):
        pwd.getpwnam(f"luban-g-{tag}")
    client = Client("http://testserver", "x")
    client.http = TestClient(api.http.app, headers=api.admin)
    monkeypatch.setattr(cluster_cli, "_client", lambda args: client)
    monkeypatch.setattr(cli, "SUBCOMMAND_MODULES", ["luban.cluster.cli"])  # as tests/cluster/conftest.py's LUBAN
    assert cli.main(["admin", "user", "add", f"g-{tag}"]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"luban: error: name = 'g-{tag}': ") and err.count("\n") == 1, err
    with pytest.raises(KeyError):
        pwd.getpwnam(f"luban-g-{tag}")


@root_only
def test_a_group_adopts_no_unix_group_that_gives_anyone_its_directories(root_api, tmp_path):
    """The account luban-g-TAGc (made before user names "g-..." were refused) has the Unix group
    luban-g-TAGc as its primary group: group TAGc must not adopt it; nor a system group, nor one with
    members. An empty group of luban's (an add that failed half-way) is adopted: the add can be repeated."""
    api, tag = root_api
    sh("useradd", "--user-group", "--no-create-home", "--shell", "/bin/sh", f"luban-g-{tag}c")
    sh("groupadd", "--system", f"luban-g-{tag}s")
    sh("groupadd", f"luban-g-{tag}m")
    sh("gpasswd", "--add", f"luban-g-{tag}c", f"luban-g-{tag}m")
    sh("groupadd", f"luban-g-{tag}e")
    for suffix, why in (("c", f"is the primary group of account luban-g-{tag}c"), ("s", "is a system group"),
                        ("m", f"has members already (luban-g-{tag}c)")):
        data = tmp_path / suffix
        r = post(api, "/groups", {"name": tag + suffix, "data_dir": str(data)})
        assert r.status_code == 422, r.text
        detail = r.json()["detail"]
        assert detail.startswith(f"name = '{tag}{suffix}': a group whose Unix group luban can make: "
                                 f"luban-g-{tag}{suffix} exists and {why}") and f"groupdel luban-g-{tag}" in detail
        assert not data.exists()  # refused before anything was made
    assert [g["name"] for g in api.http.get("/api/groups", headers=api.admin).json()] == []
    assert post(api, "/groups", {"name": f"{tag}e", "data_dir": str(tmp_path / "e")}).status_code == 201
    assert (tmp_path / "e").stat().st_gid == grp.getgrnam(f"luban-g-{tag}e").gr_gid


# -- 3 ---------------------------------------------------------------------------------------------
@root_only
def test_a_data_dir_through_a_symbolic_link_is_refused_and_the_target_untouched(root_api, tmp_path):
    api, tag = root_api
    closed = tmp_path / "closed"
    closed.mkdir(mode=0o700)
    (tmp_path / "link").symlink_to(closed)
    (tmp_path / "file").write_text("")
    before = closed.stat()
    for key, path, why in (
            ("data_dir", tmp_path / "link", f"a path without symbolic links ({tmp_path}/link is one, to {closed})"),
            ("data_dir", tmp_path / "link" / "sub", f"a path without symbolic links ({tmp_path}/link is one"),
            ("env_dir", tmp_path / "file", f"a directory ({tmp_path}/file is not one)"),
            ("env_dir", tmp_path / "file" / "sub", f"a directory ({tmp_path}/file is not one)"),
            ("data_dir", f"{tmp_path}/x/../closed", "a path without . or .. components")):
        r = post(api, "/groups", {"name": f"{tag}a", key: str(path)})
        assert r.status_code == 422 and r.json()["detail"].startswith(f"{key} = {str(path)!r}: {why}"), r.text
    after = closed.stat()
    assert (after.st_uid, after.st_gid, after.st_mode) == (before.st_uid, before.st_gid, before.st_mode)
    assert not (closed / "sub").exists() and not (tmp_path / "x").exists()
    with pytest.raises(KeyError):
        grp.getgrnam(f"luban-g-{tag}a")  # no group made for a refused add
    shared, env = tmp_path / "new" / "shared", tmp_path / "env"
    assert post(api, "/groups", {"name": f"{tag}a", "data_dir": str(shared), "env_dir": str(env)}).status_code == 201
    for made in (shared, env):
        st = made.lstat()
        assert stat.S_ISDIR(st.st_mode) and (st.st_uid, st.st_gid) == (0, grp.getgrnam(f"luban-g-{tag}a").gr_gid)
        assert stat.S_IMODE(st.st_mode) == 0o2770


def test_open_dir_refuses_a_final_link_to_a_directory(tmp_path):
    """The fd the group's chown and chmod go through (no root needed: nothing is changed)."""
    (tmp_path / "d").mkdir()
    (tmp_path / "l").symlink_to(tmp_path / "d")
    with pytest.raises(LubanError, match=r"^data_dir = .*: a path without symbolic links \(.*/l is one, to "):
        accounts._open_dir("data_dir", str(tmp_path / "l"))
    fd = accounts._open_dir("data_dir", str(tmp_path / "d" / "e"))
    try:
        assert os.fstat(fd).st_ino == (tmp_path / "d" / "e").stat().st_ino
    finally:
        os.close(fd)


# -- 4 ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("path", ["/docs", "/redoc", "/openapi.json", "/docs/oauth2-redirect"])
def test_no_api_docs_are_served(in_process, path):
    api = in_process()
    for headers in ({}, api.admin):
        r = api.http.get(path, headers=headers)
        assert r.status_code == 404 and "swagger" not in r.text.lower() and "openapi" not in r.text.lower(), r.text


# -- 5 ---------------------------------------------------------------------------------------------
BOMB = "name: j\ncommand: 'true'\nbomb:\n  - &a0 [x, x, x, x, x, x, x, x, x]\n" + "".join(
    f"  - &a{i} [{', '.join([f'*a{i - 1}'] * 9)}]\n" for i in range(1, 7))  # under an unknown key: 9**6 x's


@pytest.mark.parametrize("text", ["name: j\ncommand: &c 'true'\nargs: [*c]\n", BOMB], ids=["alias", "bomb"])
def test_submit_refuses_yaml_aliases_before_expanding_them(tmp_path, monkeypatch, capsys, text):
    from luban import cli

    monkeypatch.setattr(cli, "SUBCOMMAND_MODULES", ["luban.cluster.cli"])  # as tests/cluster/conftest.py's LUBAN
    (tmp_path / "job.yaml").write_text(text)
    monkeypatch.chdir(tmp_path)
    assert cli.main(["submit", "--url", "http://127.0.0.1:9", "--token", "x", "job.yaml"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("luban: error: job.yaml is not valid YAML: aliases (*name) are not allowed in a job "
                          "spec") and err.count("\n") == 1, err
