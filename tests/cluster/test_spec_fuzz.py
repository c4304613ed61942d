"""The job spec is what every ``POST /jobs`` body and ``luban submit`` file becomes: malformed
specs, as JSON values or YAML text, are one-line ``LubanError``s (the service's 422), never
another exception, and what is accepted is within the declared types and ranges."""

import math

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
