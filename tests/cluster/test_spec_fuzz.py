"""The job spec is what every ``POST /jobs`` body and ``luban submit`` file becomes: malformed
specs, as JSON values or YAML text, are one-line ``LubanError``s (the service's 422), never
another exception, and what is accepted is within the declared types and ranges."""

import math

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from luban.cluster import spec
from luban.errors import LubanError

NASTY = st.one_of(
    st.none(), st.booleans(), st.integers(min_value=-(1 << 80), max_value=1 << 80),
    st.floats(allow_nan=True, allow_infinity=True), st.text(max_size=20),
    st.sampled_from(["", "\x00", "/abs/path", "rel/path", "A" * 300, "NAME=x", "1:00:00", "∞"]),
    st.lists(st.one_of(st.text(max_size=5), st.integers()), max_size=3),
    st.dictionaries(st.text(max_size=5), st.one_of(st.text(max_size=5), st.integers(), st.none()), max_size=3))
KEYS = st.sampled_from([*spec.FIELDS, "bogus", ""])


def _one_line_error_or_sane(parse, value) -> None:
    try:
        job = parse(value)
    except LubanError as err:
        assert str(err) and "\n" not in str(err)
        return
    _accepted_is_sane(job)


def _accepted_is_sane(job) -> None:
    assert isinstance(job.name, str) and job.name and isinstance(job.command, str) and job.command
    assert all(isinstance(a, str) for a in job.args)
    assert isinstance(job.nodes, int) and not isinstance(job.nodes, bool) and job.nodes >= 1
    if job.time_limit is not None:
        assert isinstance(job.time_limit, (int, float)) and math.isfinite(job.time_limit) and job.time_limit >= 1


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.dictionaries(KEYS, NASTY, max_size=6), st.booleans())
def test_fuzzed_specs_are_one_line_errors_or_sane(fields, complete):
    _one_line_error_or_sane(spec.parse, ({"name": "j", "command": "true"} | fields) if complete else fields)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.text(max_size=200))
def test_fuzzed_yaml_is_a_one_line_error_or_a_sane_spec(text):
    _one_line_error_or_sane(spec.parse_yaml, text)



@pytest.mark.parametrize("fields,words", [
    ({"priority": "²"}, "priority = '²'"),                    # str.isdigit() says yes, int() says no
    ({"priority": "9" * 5000}, "priority = '999"),            # more digits than int() converts
    ({"priority": "--5"}, "priority = '--5'"),
    ({"name": "job\n"}, r"name = 'job\n': must match"),      # "$" matched before a trailing newline
    ({"group": "g\n"}, r"group = 'g\n'"),
    ({"node_group": "default\n"}, r"node_group = 'default\n'"),
    ({"env": {"A\nB": "x"}}, r"env['A\nB'] = 'x': variable names"),
    ({"env": {"A\n": "x"}}, r"env['A\n']"),
])
def test_names_and_levels_that_once_passed_or_crashed_are_one_line(fields, words):
    """A hostile sweep (2026-11-27): '²' or 5000 digits as a priority was a ValueError (HTTP 500,
    a traceback from `luban submit job.yaml`); names with a trailing newline were accepted."""
    with pytest.raises(LubanError) as err:
        spec.parse({"name": "j", "command": "true"} | fields)
    assert words in str(err.value) and "\n" not in str(err.value), str(err.value)


@pytest.mark.parametrize("text,words", [
    ("name: j\ncommand: x\nnodes: " + "9" * 5000, "Exceeds the limit"),
    ("name: j\ncommand: x\nargs: " + "[" * 3000 + "]" * 3000, "nested too deeply"),
])
def test_yaml_python_cannot_hold_is_one_line(text, words):
    with pytest.raises(LubanError, match=words) as err:
        spec.parse_yaml(text)
    assert "\n" not in str(err.value) and str(err.value).startswith("yaml = '<")


@pytest.mark.parametrize("where", ["command", "args", "env"])
def test_a_string_no_program_can_be_started_with_is_refused_at_submission(where):
    """2026-11-28: a 200 KB argument or environment value (the spec allows 256 KiB) was accepted and
    every attempt failed at launch ("Argument list too long"). The longest string that fits is
    accepted and does start."""
    import subprocess

    def spec_with(size: int) -> dict:
        if where == "command":
            return {"name": "j", "command": "/" + "x" * (size - 1)}
        if where == "args":
            return {"name": "j", "command": "true", "args": ["x" * size]}
        return {"name": "j", "command": "true", "env": {"BIG": "x" * (size - len("BIG="))}}

    with pytest.raises(LubanError) as err:
        spec.parse(spec_with(spec.MAX_ARG + 1))
    assert "\n" not in str(err.value) and f"at most {spec.MAX_ARG} bytes" in str(err.value)
    fits = spec.parse(spec_with(spec.MAX_ARG))
    if where != "command":  # the longest accepted string does start
        subprocess.run(["true", *fits.args], env=fits.env, check=True, timeout=60)
