"""Node names: what a node may call itself, and the safe form of any other name.

A node's name is shown in logs, reports and the serve endpoint's /metrics labels, and comes
from a stranger. A newline in it injected lines into /metrics. So a name is 1-64 characters
of [A-Za-z0-9._-]: a node refuses to start with another --name, and a coordinator admitting
a node that calls itself something else uses the safe form (`safe_node_name`) instead.
"""

from __future__ import annotations

import re

MAX_NAME = 64
NAME_RE = re.compile(r"[A-Za-z0-9._-]{1,64}")
_UNSAFE = re.compile(r"[^A-Za-z0-9._-]")


def name_problem(name: str) -> str:
    """'' if `name` is a valid node name, else what is wrong with it."""
    if NAME_RE.fullmatch(name):
        return ""
    if not name:
        return "a node name cannot be empty"
    if len(name) > MAX_NAME:
        return f"a node name has at most {MAX_NAME} characters, not {len(name)}"
    return f"a node name is made of A-Z a-z 0-9 . _ - only, not {name!r}"


def safe_node_name(name: str) -> str:
    """`name` if valid; else every other character replaced by '_', cut to 64 ('_' if
    empty). Distinct bad names may share a safe form: a node's id, not its name, is who it is."""
    return _UNSAFE.sub("_", name)[:MAX_NAME] or "_"
