"""The job spec users submit (YAML or JSON): validated into a ``JobSpec`` or one clear error."""

from __future__ import annotations

import dataclasses
import json
import re

import yaml

from luban import jobenv
from luban.cluster import priority as prio
from luban.errors import LubanError, bad_value, plain_name

JOBS_LIMIT = 100           # rows GET /api/jobs answers by default: the newest (luban jobs --limit)
JOBS_LIMIT_MAX = 10_000    # rows one GET /api/jobs answers at most; more: pages (before=ID)
MAX_YAML = 64 << 10        # bytes of a YAML job spec
MAX_TIME_LIMIT = 365 * 24 * 3600
MAX_SPEC = 256 << 10       # bytes of a job spec as JSON (args + env + the rest)
MAX_ARG = (128 << 10) - 1  # bytes of one argument or one NAME=value environment entry: execve refuses a
                           # longer string (Linux MAX_ARG_STRLEN, with its NUL) — the job could never start
NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$")
# a submission's Idempotency-Key (client.SUBMIT_KEY_HEADER; a uuid4 by default): 64 characters fit jobs.submit_key
SUBMIT_KEY_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.:-]{0,63}$")
# how long a key makes its submission at most once: a repeat within it answers the job the key made, one
# after it makes a new job (the old job's key is cleared: service.py, submit). Stripe's lifetime: "You can
# remove keys from the system automatically after they're at least 24 hours old. We generate a new request
# if a key is reused after the original is pruned" (docs.stripe.com/idempotency)
SUBMIT_KEY_TTL_S = 24 * 3600
ENV_RE = jobenv.NAME_RE


@dataclasses.dataclass
class JobSpec:
    """What to run and where: ``command`` + ``args`` on ``nodes`` whole nodes of ``node_group``."""

    name: str
    command: str
    args: list[str] = dataclasses.field(default_factory=list)
    env: dict[str, str] = dataclasses.field(default_factory=dict)
    env_only: bool = False  # True: the job's environment is exactly `env` (+ luban's variables)
    workdir: str | None = None
    nodes: int = 1
    priority: str = "NORMAL"
    group: str | None = None
    node_group: str | None = None  # None: "default", or the cluster's only node group
    time_limit: int | None = None  # seconds an attempt may run before it is killed (None: no limit)

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


FIELDS = [f.name for f in dataclasses.fields(JobSpec)]


def _str(data: dict, key: str, required: bool = False, pattern: re.Pattern | None = None) -> str | None:
    value = data.get(key)
    if value is None:
        if required:
            raise LubanError(f"{key} is missing: a non-empty string is required")
        return None
    if not isinstance(value, str) or not value.strip():
        raise bad_value(key, value, "a non-empty string")
    _no_nul(key, value)
    if pattern is not None and not pattern.fullmatch(value):  # fullmatch: "$" would let "x\n" through
        raise bad_value(key, value, f"must match {pattern.pattern}")
    return value


def _no_nul(key: str, value: str) -> None:
    """A job cannot launch with a NUL byte in its command, an argument, a path or the environment
    (execve takes C strings): refused at submission, not at launch."""
    if "\x00" in value:
        raise bad_value(key, value, "text without NUL bytes (no command line, path or environment entry can hold one)")


def _exec_size(key: str, value: str, extra: int = 0) -> None:
    """One string of a command line or environment longer than execve takes: refused at submission
    (it was accepted and the attempt failed at launch: "Argument list too long")."""
    size = len(value.encode("utf-8", "surrogateescape")) + extra
    if size > MAX_ARG:
        raise bad_value(key, f"<{size} bytes>", f"at most {MAX_ARG} bytes (the longest string a program can be "
                                                "started with; pass more through a file)")


def _command(data: dict) -> str:
    command = _str(data, "command", required=True)
    _exec_size("command", command)
    return command


def parse(data) -> JobSpec:
    """Validate a mapping (already-parsed YAML/JSON) into a ``JobSpec``."""
    if not isinstance(data, dict):
        raise bad_value("spec", data, "a mapping with keys " + ", ".join(FIELDS))
    unknown = sorted(set(data) - set(FIELDS))
    if unknown:
        raise bad_value(unknown[0], data[unknown[0]], "unknown key; allowed keys are " + ", ".join(FIELDS))
    args = data.get("args", [])
    if not isinstance(args, list):
        raise bad_value("args", args, "a list of strings")
    for i, a in enumerate(args):
        # an integer's text is exact; a float's is not what was written (YAML 0.00003 -> "3e-05")
        if not isinstance(a, (str, int)) or isinstance(a, bool):
            raise bad_value(f"args[{i}]", a, "a string or an integer (quote other values in YAML: \"3e-4\", \"true\")")
        _no_nul(f"args[{i}]", str(a))
        _exec_size(f"args[{i}]", str(a))
    env = data.get("env")
    env = {} if env is None else env  # YAML's empty `env:`; not 0, "", [] or false (a list of KEY=VALUE lost)
    if not isinstance(env, dict):
        raise bad_value("env", env, "a mapping of NAME: value")
    for k, v in env.items():
        if not isinstance(k, str) or not ENV_RE.fullmatch(k):
            raise bad_value(f"env.{k}" if plain_name(k) else f"env[{k!r}]", v,
                            "variable names must match " + ENV_RE.pattern)
        if not isinstance(v, str):  # strict: 5 is not silently "5" (docs/platform.md)
            raise bad_value(f"env.{k}", v, "a string (quote it in YAML: \"5\", \"true\")")
        _no_nul(f"env.{k}", v)
        _exec_size(f"env.{k}", v, len(k.encode()) + 1)
    time_limit = data.get("time_limit")
    if time_limit is not None and (isinstance(time_limit, bool) or not isinstance(time_limit, int)
                                   or not 1 <= time_limit <= MAX_TIME_LIMIT):
        raise bad_value("time_limit", time_limit, f"whole seconds from 1 to {MAX_TIME_LIMIT} (a year)")
    env_only = data.get("env_only", False)
    if not isinstance(env_only, bool):
        raise bad_value("env_only", env_only, "true or false")
    nodes = data.get("nodes", 1)
    if isinstance(nodes, bool) or not isinstance(nodes, int) or nodes < 1:
        raise bad_value("nodes", nodes, "an integer >= 1 (whole nodes)")
    priority = prio.parse(data.get("priority", "NORMAL"))
    workdir = _str(data, "workdir")
    if workdir is not None and not workdir.startswith("/"):
        raise bad_value("workdir", workdir, "an absolute path")
    size = len(json.dumps(data, default=str))
    if size > MAX_SPEC:
        raise bad_value("spec", f"<{size} bytes>", f"at most {MAX_SPEC} bytes (command, args and env together)")
    return JobSpec(
        name=_str(data, "name", required=True, pattern=NAME_RE),
        command=_command(data),
        args=[str(a) for a in args],
        env=dict(env),
        env_only=env_only,
        time_limit=time_limit,
        workdir=workdir,
        nodes=nodes,
        priority=priority if isinstance(priority, str) else priority.name,
        group=_str(data, "group", pattern=NAME_RE),
        node_group=_str(data, "node_group", pattern=NAME_RE),
    )


class _NoAliasLoader(yaml.SafeLoader):
    """Safe YAML without anchors/aliases: a job spec needs none, and nested aliases expand a few
    hundred bytes into gigabytes ("billion laughs")."""

    def compose_node(self, parent, index):
        if self.check_event(yaml.AliasEvent):
            event = self.peek_event()
            raise yaml.composer.ComposerError(None, None, "aliases (*name) are not allowed in a job spec",
                                              event.start_mark)
        return super().compose_node(parent, index)


def parse_yaml(text: str) -> JobSpec:
    """Parse YAML text (at most MAX_YAML bytes, no aliases); a syntax error names the line."""
    if not isinstance(text, str):
        raise bad_value("yaml", text, "the job spec as a YAML string")
    if len(text.encode()) > MAX_YAML:
        raise bad_value("yaml", f"<{len(text.encode())} bytes>", f"at most {MAX_YAML} bytes")
    try:
        data = yaml.load(text, Loader=_NoAliasLoader)  # noqa: S506 - a SafeLoader subclass
    except yaml.YAMLError as err:
        raise LubanError(f"job spec is not valid YAML: {err}".replace("\n", " ")) from None
    except (ValueError, RecursionError) as err:  # an integer of 5000 digits; [[[[...]]]] nested too deeply
        why = "nested too deeply" if isinstance(err, RecursionError) else str(err).split(";")[0]
        raise bad_value("yaml", f"<{len(text.encode())} bytes>", f"a job spec YAML luban can read ({why})") from None
    return parse(data)
