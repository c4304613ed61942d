"""Hard API limits: bodies capped before they are read, tokens checked before bodies are parsed,
safe YAML, strict types, per-user queue limits, no 500s, tokens never in the logs."""

from __future__ import annotations

import httpx
import pytest

from tests.cluster.conftest import wait_for

LAUGHS = "a: &a [x, x, x, x, x, x, x, x, x]\n" + "".join(
    f"{chr(98 + i)}: &{chr(98 + i)} [*{chr(97 + i)}, *{chr(97 + i)}, *{chr(97 + i)}, *{chr(97 + i)}]\n"
    for i in range(8)) + "name: j\ncommand: *i\n"


@pytest.fixture(scope="module")
def api(tmp_path_factory):
    from tests.cluster.conftest import Service

    svc = Service(tmp_path_factory.mktemp("limits"), ["--nodes", "1", "--tick", "0.2", "--max-queued", "2",
                                                      "--max-body", "65536"]).start()
    token, alice = svc.user("alice", {"NORMAL": 1})
    yield svc, token, alice
    svc.stop()
    from tests.cluster.conftest import kill_jobs

    kill_jobs(svc.state)


def call(svc, method, path, token=None, headers=None, **kw):
    headers = {**(headers or {}), **({"Authorization": f"Bearer {token}"} if token else {})}
    return httpx.request(method, svc.url + "/api" + path, headers=headers, timeout=30, **kw)


def test_bodies_over_the_cap_are_refused_before_reading_and_before_the_token(api):
    svc, token, _ = api
    big = b"x" * (2 << 20)
    for who in (None, "wrong", token):
        r = call(svc, "POST", "/jobs", who, content=big, headers={"content-type": "application/json"})
        assert (who, r.status_code) == (who, 413), r.text[:300]
        assert "at most 65536 bytes" in r.json()["detail"]

    def chunks():  # no Content-Length: counted as it arrives
        for _ in range(64):
            yield b"x" * 4096

    r = call(svc, "POST", "/jobs", token, content=chunks())
    assert r.status_code == 413, r.text[:300]


def test_a_spec_over_its_size_limit_is_refused():
    from luban.cluster import spec as specs
    from luban.errors import LubanError

    with pytest.raises(LubanError, match="at most 262144 bytes"):
        specs.parse({"name": "j", "command": "true", "args": ["a" * 100_000] * 3})  # each fits execve (spec.MAX_ARG)


def test_token_is_checked_before_the_body_is_parsed(api):
    svc, _, _ = api
    r = call(svc, "POST", "/jobs", None, content=b"{not json")
    assert r.status_code == 401
    r = call(svc, "PUT", "/quota", "nope", json={"owner": "user:x", "priority": "HIGH", "nodes": 1})
    assert r.status_code == 401


@pytest.mark.parametrize("method,path,body,status,words", [
    ("POST", "/jobs", {"yaml": LAUGHS}, 422, "aliases"),
    ("POST", "/jobs", {"yaml": None}, 422, "yaml"),
    ("POST", "/jobs", {"yaml": "x" * 70000}, 413, "bytes"),
    ("POST", "/jobs", [1, 2], 422, "body = '[1,2]': a JSON object"),
    ("POST", "/jobs", {"spec": {"name": "j", "command": "true", "nodes": 2 ** 70}}, 422, "nodes"),
    ("GET", "/jobs/1/logs?offset=-1", None, 422, "offset"),
    ("GET", f"/jobs/{2 ** 63}", None, 404, "not found"),
    ("GET", f"/jobs/{2 ** 70}/events", None, 404, "not found"),
    ("GET", "/samples?since=nan", None, 422, "since"),
    # a hostile sweep (2026-11-27): a 500, a name with a newline accepted, a detail of two lines
    ("POST", "/jobs", {"yaml": "name: j\ncommand: x\nnodes: " + "9" * 5000}, 422, "Exceeds the limit"),
    ("POST", "/jobs", {"spec": {"name": "j", "command": "true", "priority": "²"}}, 422, "priority = '²'"),
    ("POST", "/jobs", {"spec": {"name": "j\n", "command": "true"}}, 422, "name = 'j\\n'"),
    ("POST", "/jobs", {"spec": {"name": "j", "command": "true", "env": {"A\nB": "x"}}}, 422, "env['A\\nB']"),
    ("GET", "/jobs/a%0Ab", None, 422, "job_id = 'a\\nb'"),
])
def test_bad_input_is_a_one_line_4xx_never_a_500(api, method, path, body, status, words):
    svc, token, alice = api
    if "logs" in path:
        job = alice.submit({"name": "log", "command": "true"})["id"]
        path = path.replace("/jobs/1/", f"/jobs/{job}/")
    r = call(svc, method, path, token, json=body) if body is not None else call(svc, method, path, token)
    assert r.status_code == status, r.text[:300]
    detail = r.json()["detail"]
    assert isinstance(detail, str) and "\n" not in detail and words in detail


JSON = {"content-type": "application/json"}


@pytest.mark.parametrize("path,content,headers,start", [
    ("/jobs", b"{not json", JSON, "body = '{not json': a JSON object (Content-Type: application/json); "
                                   "invalid JSON at line 1 column 2: Expecting property name"),
    ("/jobs", b'{"spec": "\xff"}', JSON, "body = b'{\"spec\": \"\\xff\"}': a JSON object (Content-Type: "
                                         "application/json); byte 10 is not UTF-8"),
    ("/jobs", b"[" * 30_000 + b"]" * 30_000, JSON, "body = '[[[["),
    ("/jobs", b'{"spec": ' + b"9" * 5000 + b"}", JSON, "body = '{\"spec\": 9999"),
    ("/jobs", b'{"spec": {"name": "j", "command": "true"}}', {}, "Content-Type = '(none)': application/json: "
                                                                 "the body is a JSON object"),
    ("/jobs", b'{"spec": {"name": "j", "command": "true"}}', {"content-type": "text/plain"},
     "Content-Type = 'text/plain': application/json"),
    ("/quota", b'{"owner": "user:alice",', JSON, "body = '{\"owner\": \"user:alice\",': a JSON object"),
])
def test_a_body_that_is_not_a_json_object_is_one_line_naming_the_body(api, path, content, headers, start):
    """A sweep of 2026-11-27: invalid JSON was '1 = {}: JSON decode error'; a body that is not UTF-8,
    nested 30 000 deep or holding a 5000-digit integer a 400 'There was an error parsing the body'
    naming nothing; no or another Content-Type "request = b'...': Input should be a valid dictionary"."""
    svc, token, _ = api
    r = call(svc, "PUT" if path == "/quota" else "POST", path, svc.admin_token if path == "/quota" else token,
             headers=headers, content=content)
    detail = r.json()["detail"]
    assert r.status_code == 422 and isinstance(detail, str) and "\n" not in detail, (r.status_code, detail)
    assert detail.startswith(start) and "JSON object" in detail and len(detail) < 300, detail
    assert ("nested too deeply" in detail) == content.startswith(b"[[")
    assert ("Exceeds the limit (4300 digits)" in detail) == (b"9" * 5000 in content)


@pytest.mark.parametrize("method,path,body,words", [
    ("PUT", "/jobs/{job}/whole_life_state", {"value": 2 ** 70}, "value"),
    ("PUT", "/jobs/{job}/whole_life_state", {"value": True}, "value"),
    ("PUT", "/quota", {"owner": "user:alice", "priority": "HIGH", "nodes": 2 ** 70}, "nodes"),
    ("PUT", "/quota", {"owner": "user:alice", "priority": "HIGH", "nodes": 1, "node_group": ["x"]}, "node_group"),
    ("POST", "/users", {"name": "mallory", "admin": "false"}, "admin"),
    ("PATCH", "/users/alice", {"admin": "yes"}, "admin"),
    ("PATCH", "/users/alice", {"group": 7}, "group"),
    ("POST", "/groups", {"name": "g1", "data_dir": "relative/path"}, "data_dir"),
    # a hostile sweep (2026-11-27): each was accepted, or a 500
    ("PUT", "/quota", {"owner": "user:alice", "priority": "²", "nodes": 1}, "priority"),
    ("PUT", "/quota", {"owner": "user:alice", "priority": "9" * 5000, "nodes": 1}, "priority"),
    ("POST", "/users", {"name": "mallory\n"}, "name = 'mallory\\n'"),
    ("POST", "/groups", {"name": "g1\n"}, "name = 'g1\\n'"),
    ("POST", "/groups", {"name": "g1", "data_dir": "/data/a\x00b"}, "data_dir"),  # in every member's job env
    ("POST", "/groups", {"name": "g1", "env_dir": "/" + "e" * 600}, "env_dir"),  # the column holds 512
    ("PATCH", "/users/admin", {"admin": False}, "only admin"),  # no one could manage the cluster
])
def test_admin_fields_have_strict_types(api, method, path, body, words):
    svc, _, alice = api
    admin = svc.admin_token
    path = path.replace("{job}", str(alice.jobs(all_attempts=True)[0]["id"] if alice.jobs(all_attempts=True)
                                     else alice.submit({"name": "x", "command": "true"})["id"]))
    r = call(svc, method, path, admin, json=body)
    assert r.status_code == 422, r.text[:300]
    assert words in r.json()["detail"] and "\n" not in r.json()["detail"]
    users = {u["name"]: u for u in svc.admin().call("GET", "/users")}
    assert not any(n.startswith("mallory") for n in users) and not users["alice"]["admin"]  # nothing created or raised
    assert users["admin"]["admin"] and not any(g["name"].startswith("g1") for g in svc.admin().groups())
    assert [(q["owner"], q["priority_name"]) for q in svc.admin().quota()] == [("user:alice", "NORMAL")]


def test_queued_jobs_per_user_are_limited(api):
    svc, _, alice = api
    alice.submit({"name": "hold", "command": "sleep", "args": ["600"]})
    wait_for(lambda: any(j["state"] == "running" for j in alice.jobs()), 60, what="a running job")
    queued = [alice.submit({"name": f"q{i}", "command": "true"})["id"] for i in range(2)]
    r = call(svc, "POST", "/jobs", alice.http.headers["Authorization"][7:],
             json={"spec": {"name": "q3", "command": "true"}})
    assert r.status_code == 429 and "limit is 2" in r.json()["detail"]
    for job in queued + [j["id"] for j in alice.jobs() if j["name"] == "hold"]:
        alice.stop(job)


def test_tokens_never_reach_the_log(api):
    svc, token, _ = api
    assert httpx.get(f"{svc.url}/api/whoami?token={token}", timeout=10).status_code == 200
    assert httpx.get(f"{svc.url}/?token={token}", timeout=10).status_code == 200
    wait_for(lambda: "token=***" in svc.log.read_text(), 10, what="the access log line")
    assert token not in svc.log.read_text()


def test_args_are_strings_or_integers_never_rewritten_floats():
    """YAML reads ``--lr 0.00003`` as a float whose text is '3e-05': refused with the index and
    how to quote it; an integer's decimal text is exact and passes."""
    from luban.cluster import spec as specs
    from luban.errors import LubanError

    assert specs.parse({"name": "j", "command": "true", "args": ["--steps", 100]}).args == ["--steps", "100"]
    for bad in (0.00003, True, None, [1], {"a": 1}):
        with pytest.raises(LubanError, match=r"args\[1\] = .*a string or an integer \(quote other values"):
            specs.parse({"name": "j", "command": "true", "args": ["--lr", bad]})
