"""Job priorities: named integer levels; AUTO picks the highest level where quota is left."""

from __future__ import annotations

import enum
import re

from luban.errors import bad_value


class Priority(enum.IntEnum):
    """Scheduling priority; a higher value is served first and may preempt lower ones."""

    EXTREME_HIGH = 50
    VERY_HIGH = 40
    HIGH = 30
    ABOVE_NORMAL = 20
    NORMAL = 10
    UNDER_NORMAL = 8
    BELOW_NORMAL = 5
    LOW = 0


AUTO = "AUTO"
LEVELS = sorted(Priority, reverse=True)
ALLOWED = ", ".join(p.name for p in LEVELS) + f", {AUTO} or one of the integers {[int(p) for p in LEVELS]}"


def parse(value, key: str = "priority") -> Priority | str:
    """A ``Priority`` from a name or integer, or the string ``AUTO``; anything else is a LubanError."""
    if isinstance(value, Priority):
        return value
    if isinstance(value, str) and value.strip().upper() == AUTO:
        return AUTO
    if isinstance(value, str) and value.strip().upper() in Priority.__members__:
        return Priority[value.strip().upper()]
    if isinstance(value, int) and not isinstance(value, bool) and value in Priority._value2member_map_:
        return Priority(value)
    if isinstance(value, str) and re.fullmatch(r"\s*-?[0-9]{1,4}\s*", value):  # not '²', '--5' or 5000 digits
        return parse(int(value), key)
    raise bad_value(key, value, f"one of {ALLOWED}")


def resolve_auto(quota: dict[Priority, int], used: dict[Priority, int], nnodes: int) -> Priority | None:
    """AUTO: the highest level whose unused quota covers ``nnodes``; else the highest whose quota
    could ever cover it (the job then queues); ``None`` when no level can."""
    for level in LEVELS:
        if quota.get(level, 0) - used.get(level, 0) >= nnodes:
            return level
    for level in LEVELS:
        if quota.get(level, 0) >= nnodes:
            return level
    return None
