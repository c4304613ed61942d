"""``Client``: the Python SDK for the cluster API, used by the CLI and by scripts.

``Client()`` reads LUBAN_CLUSTER_URL and LUBAN_CLUSTER_TOKEN (a running job has both); an API
error becomes an ``ApiError`` (a ``LubanError``) carrying the server's one-line explanation and
its HTTP status (409: the job's state does not allow the request; nothing was changed).
"""

from __future__ import annotations

import os
import time
import uuid
from collections.abc import Iterator
from urllib.parse import quote

import httpx

from luban.cluster.spec import JOBS_LIMIT_MAX  # rows one GET /api/jobs answers at most
from luban.cluster.spec import SUBMIT_KEY_RE  # a submission's Idempotency-Key, as the service checks it
from luban.cluster.spec import SUBMIT_KEY_TTL_S  # how long the service makes a key's submission at most once
from luban.errors import LubanError, bad_value, escaped, without_password

SERVICE_HEADER = "x-luban-cluster"  # luban.cluster.service marks every answer with it
TOTAL_HEADER = "X-Total-Count"      # GET /api/jobs: how many rows match in all (the answer has at most limit)
# a URL's user[:password]@ is refused: httpx sends it as Basic auth in place of the bearer token (every call a 401)
CREDENTIALS_IN_URL = "no user:password@ (luban sends its token; httpx would send the URL's credentials instead)"
# why a URL with a password is refused, where httpx's own reason may quote part of the password
UNPARSED_PASSWORD = "not read as one; a password holding '/', '?', '#' or '@' must be percent-encoded: %2F %3F %23 %40"

SUBMIT_KEY_HEADER = "Idempotency-Key"  # POST /api/jobs: one submission per user and key (the IETF draft's header)
SUBMIT_RETRY_S = 20.0  # seconds submit() retries a POST sent but not answered (the service died, or restarts),
                       # or answered 503 (the database failed, maybe after its COMMIT), with the same key: the
                       # service makes the job at most once

DEFAULT_URL = "http://127.0.0.1:8765"
RETRY_STATUS = 503  # the service is up but its database is not (restarting): retried like an unreachable
                   # service, within retry_for. What was asked may have been done (a COMMIT whose answer the
                   # outage lost): a submission is retried with its key, and its last error says how to repeat it


def new_key() -> str:
    """A new Idempotency-Key for a submission (a uuid4): what ``submit`` uses when given none."""
    return uuid.uuid4().hex


class ApiError(LubanError):
    """The service's refusal of one call (HTTP ``status`` >= 400), carrying its one-line explanation."""

    def __init__(self, message: str, status: int):
        super().__init__(message)
        self.status = status


class JobList(list):
    """``Client.jobs``'s answer: a list of jobs, oldest first, and ``total``: how many matched in all
    (``total - len(rows)`` were left out by the limit)."""

    def __init__(self, rows=(), total: int | None = None):
        super().__init__(rows)
        self.total = len(self) if total is None else total


class Client:
    def __init__(self, url: str | None = None, token: str | None = None, timeout: float = 30.0,
                 retry_for: float = 0.0):
        """``retry_for``: seconds to keep retrying when the service cannot be reached or its database
        is unavailable (503) — a running job's SDK calls ride out a service or database restart this way."""
        self.retry_for = retry_for
        self.url = (url or os.environ.get("LUBAN_CLUSTER_URL") or DEFAULT_URL).rstrip("/")
        token = token or os.environ.get("LUBAN_CLUSTER_TOKEN")
        if not token:
            raise LubanError("LUBAN_CLUSTER_TOKEN is not set: pass --token or export the token an admin gave you")
        if not (token.isascii() and token.strip().isprintable() and token.strip()):  # never shown: a secret
            raise bad_value("--token", "<hidden>", "a token as luban printed it (printable ASCII; this one holds "
                                                   "a control or non-ASCII character: check $LUBAN_CLUSTER_TOKEN)")
        token = token.strip()
        try:
            self.http = httpx.Client(base_url=self.url, headers={"Authorization": f"Bearer {token}"}, timeout=timeout)
            base = self.http.base_url
            if base.scheme not in ("http", "https") or not base.host:
                raise ValueError("not http(s)://HOST[:PORT]")  # (ours: a ValueError, httpx's is an InvalidURL)
            if base.port is not None and not 1 <= base.port <= 65535:
                raise ValueError(f"port {base.port} is not from 1 to 65535")
            if base.userinfo:  # httpx sends a URL's user:password as Basic auth in place of the token: 401
                raise ValueError(CREDENTIALS_IN_URL)  # (so self.url, once accepted, holds no password to hide)
        except (httpx.InvalidURL, ValueError) as err:  # --url or $LUBAN_CLUSTER_URL: 'http://[::1', 'ftp://x'
            shown = without_password(self.url)
            # httpx's reason may quote the password (http://alice:s3cr#t@h: "Invalid port: 's3cr'"): not then
            why = err if shown == self.url or not isinstance(err, httpx.InvalidURL) else UNPARSED_PASSWORD
            raise bad_value("--url", shown, f"the service's http(s)://HOST[:PORT] ({why})") from None

    def call(self, method: str, path: str, **kwargs):
        return self.request(method, path, **kwargs)[0]

    def request(self, method: str, path: str, unanswered_retry_for: float = 0.0, unanswered_hint: str = "",
                **kwargs) -> tuple:
        """``call``'s answer and the response's headers. ``unanswered_retry_for``: seconds to retry
        (at least) once a request was sent and got no answer or a 503 — either may come after it was
        done — only for a request that may be repeated (a submission with its key);
        ``unanswered_hint`` ends the last error's line in that case ("unreachable", or the 503)."""
        start = time.monotonic()
        deadline, sent = start + self.retry_for, False
        while True:
            try:
                response = self.http.request(method, "/api" + path, **kwargs)
                if response.status_code != RETRY_STATUS:
                    break
                if not sent:  # a database that failed at (or after) the COMMIT answers 503 too: it may be done
                    sent, deadline = True, max(deadline, time.monotonic() + unanswered_retry_for)
                if time.monotonic() >= deadline:
                    break
            except httpx.TransportError as err:
                if not isinstance(err, (httpx.ConnectError, httpx.ConnectTimeout)) and not sent:  # sent: it may be done
                    sent, deadline = True, max(deadline, time.monotonic() + unanswered_retry_for)
                if time.monotonic() >= deadline:
                    hint = unanswered_hint if sent else ""
                    raise LubanError(f"cluster service at {self.url} is unreachable: {err}{hint}") from None
            time.sleep(1.0)
        try:
            body = response.json()
        except ValueError:  # a web server's or proxy's page, not luban's answer
            body = None
        if response.status_code >= 400:
            detail = body.get("detail") if isinstance(body, dict) else None
            if detail is None or not str(detail).strip():  # not luban's service (a web server's empty 404)
                detail = f"{method} {path} answered without a message: is {self.url} a luban cluster service?"
            detail = escaped(" ".join(str(detail).split()))
            hint = unanswered_hint if response.status_code == RETRY_STATUS else ""
            raise ApiError(f"{detail[:2000]} (HTTP {response.status_code}){hint}", response.status_code)  # no control codes
        if body is None or SERVICE_HEADER not in response.headers:  # another web server or API at the URL
            raise LubanError(f"{method} {path} answered HTTP {response.status_code} "
                             f"({response.headers.get('content-type') or 'no content type'}) without luban's mark: "
                             f"is {self.url} a luban cluster service? (check --url or $LUBAN_CLUSTER_URL)")
        return body, response.headers

    # jobs
    def submit(self, spec: dict | str, key: str | None = None, again: str | None = None) -> dict:
        """Submit a spec mapping or YAML text; returns the new job. ``key`` (default: ``new_key()``) makes
        the submission idempotent: a POST sent but not answered, or answered 503, is retried with it for
        ``SUBMIT_RETRY_S`` (or ``retry_for``), and the service answers a repeat with the job the key
        made, never a second one; the same key with another spec is refused (409). When the retries
        give up, the error says the job may have been made and ends with ``again``: how the caller
        repeats this submission with its key (the CLI: its ``luban submit --key KEY ...`` command)."""
        key = new_key() if key is None else key
        if not isinstance(key, str) or not SUBMIT_KEY_RE.fullmatch(key):  # as the service checks it (a header
            raise bad_value("key", key, f"a key matching {SUBMIT_KEY_RE.pattern}")  # httpx cannot send is a traceback)
        again = again or f"submit it again with key={key!r} (luban submit --key {key})"
        return self.request("POST", "/jobs", json={"yaml": spec} if isinstance(spec, str) else {"spec": spec},
                            headers={SUBMIT_KEY_HEADER: key}, unanswered_retry_for=SUBMIT_RETRY_S,
                            unanswered_hint=f"; the job may have been submitted: to retry without making it "
                                            f"twice (within {SUBMIT_KEY_TTL_S // 3600} h), {again}")[0]

    def jobs(self, all_attempts: bool = False, state: str | None = None, limit: int | None = None) -> JobList:
        """The newest ``limit`` jobs (None: the service's default, ``JOBS_LIMIT``), oldest first: the
        latest attempt of each chain, or every attempt. ``limit=0``: all of them, fetched in pages of
        ``JOBS_LIMIT_MAX`` (each page is read at its own moment). ``.total`` on the answer: how many
        matched in all."""
        params = {"all": all_attempts} | ({"state": state} if state else {})
        if limit != 0:
            rows, headers = self.request("GET", "/jobs", params=params | ({"limit": limit} if limit else {}))
            return JobList(rows, _total(headers, len(rows)))
        rows: list[dict] = []
        before = None
        while True:
            page, _ = self.request("GET", "/jobs", params=params | {"limit": JOBS_LIMIT_MAX}
                                   | ({"before": before} if before else {}))
            rows[:0] = page
            if len(page) < JOBS_LIMIT_MAX:
                return JobList(rows)
            before = page[0]["id"]

    def job(self, job_id: int, latest: bool = False) -> dict:
        """One attempt; ``latest``: the newest attempt of its chain."""
        return self.call("GET", f"/jobs/{job_id}", params={"latest": True} if latest else None)

    def events(self, job_id: int) -> list[dict]:
        return self.call("GET", f"/jobs/{job_id}/events")

    def stop(self, job_id: int) -> dict:
        return self.call("POST", f"/jobs/{job_id}/stop")

    def suspend(self, job_id: int) -> dict:
        return self.call("POST", f"/jobs/{job_id}/suspend")

    def logs(self, job_id: int, rank: int = 0, offset: int = 0) -> dict:
        return self.call("GET", f"/jobs/{job_id}/logs", params={"rank": rank, "offset": offset})

    def follow(self, job_id: int, rank: int = 0, poll: float = 0.5) -> Iterator[str]:
        """Yield log text as it is written, across restarts, until the chain has ended."""
        offset = 0
        while True:
            chunk = self.logs(job_id, rank, offset)
            offset = chunk["offset"]
            if chunk["text"]:
                yield chunk["text"]
            elif chunk["done"]:
                return
            else:
                time.sleep(poll)

    def wait(self, job_id: int, states=("succeeded", "failed", "stopped"), timeout: float = 600.0,
             poll: float = 0.2) -> dict:
        """Poll until the chain's latest attempt reaches one of ``states``."""
        deadline = time.monotonic() + timeout  # not the wall clock: a step back of it made this wait on and on
        while True:
            job = self.latest(job_id)
            if job["state"] in states:
                return job
            if time.monotonic() > deadline:
                raise TimeoutError(f"job {job_id} still {job['state']} after {timeout}s")
            time.sleep(poll)

    def latest(self, job_id: int) -> dict:
        """The newest attempt of ``job_id``'s chain."""
        return self.job(job_id, latest=True)

    # cluster
    def whoami(self) -> dict:
        return self.call("GET", "/whoami")

    def nodes(self) -> list[dict]:
        return self.call("GET", "/nodes")

    def set_node(self, name: str, state: str) -> dict:
        return self.call("PATCH", f"/nodes/{quote(name, safe='')}", json={"state": state})

    def quota(self) -> list[dict]:
        return self.call("GET", "/quota")

    def set_quota(self, owner: str, priority: str | int, nodes: int, node_group: str | None = None) -> dict:
        """``node_group`` None: the nodes' own group when the cluster has one, else "default"."""
        body = {"owner": owner, "priority": priority, "nodes": nodes}
        return self.call("PUT", "/quota", json=body | ({"node_group": node_group} if node_group else {}))

    def hold(self, job_id: int) -> dict:
        return self.call("POST", f"/jobs/{job_id}/hold")

    def release(self, job_id: int) -> dict:
        return self.call("POST", f"/jobs/{job_id}/release")

    def usage(self, since: float = 0.0, until: float | None = None, by: str = "user") -> list[dict]:
        params = {"since": since, "by": by} | ({"until": until} if until is not None else {})
        return self.call("GET", "/usage", params=params)

    def users(self) -> list[dict]:
        return self.call("GET", "/users")

    def add_user(self, name: str, admin: bool = False, group: str | None = None, os_user: str | None = None) -> dict:
        body = {"name": name, "admin": admin, "group": group} | ({"os_user": os_user} if os_user else {})
        return self.call("POST", "/users", json=body)

    def set_user(self, name: str, **changes) -> dict:
        return self.call("PATCH", f"/users/{quote(name, safe='')}", json=changes)

    def rotate_token(self, name: str) -> dict:
        return self.call("POST", f"/users/{quote(name, safe='')}/token")

    def groups(self) -> list[dict]:
        return self.call("GET", "/groups")

    def add_group(self, name: str, data_dir: str | None = None, env_dir: str | None = None) -> dict:
        return self.call("POST", "/groups", json={"name": name, "data_dir": data_dir, "env_dir": env_dir})

    def samples(self, since: float = 0.0) -> list[dict]:
        return self.call("GET", "/samples", params={"since": since})


def _total(headers, shown: int) -> int:
    """``TOTAL_HEADER`` as a count, or ``shown`` where it is missing or not a count (an older service)."""
    value = headers.get(TOTAL_HEADER, "")
    return int(value) if value.isdigit() and len(value) < 20 else shown
