"""Rollout ids: the keys R3 is stored under (DESIGN.md §7), and the one rule that picks them.

    rollout_id of the request  >  its `user` field (as FastDeploy keys it)  >  its request id

Never a constant: two requests without ids must not overwrite each other's R3.
"""

from __future__ import annotations

import re

_ROLLOUT_ID_RE = re.compile(r"[A-Za-z0-9._:-]{1,256}")

# Most choices one request may have (the API server caps n here). only_last_turn deletes the previous
# turn's entries for every n up to this, because that turn may have had a different n than this one.
MAX_CHOICES = 64


class InvalidRolloutIdError(ValueError):
    """A rollout id (or namespace) that cannot be used as a store key or file name."""


def validate_rollout_id(rollout_id: str, what: str = "rollout_id") -> str:
    """Return `rollout_id` if it is `[A-Za-z0-9._:-]{1,256}` and not a path component like `..`."""
    if not isinstance(rollout_id, str) or not _ROLLOUT_ID_RE.fullmatch(rollout_id):
        raise InvalidRolloutIdError(
            f"{what} {rollout_id!r} is invalid; use 1-256 characters from [A-Za-z0-9._:-] (no path separators)"
        )
    if set(rollout_id) == {"."}:
        # only dots would name the store directory or its parent in local mode
        raise InvalidRolloutIdError(f"{what} {rollout_id!r} is invalid; it must not consist of dots only")
    return rollout_id


def resolve_rollout_id(rollout_id: str | None, user: str | None, request_id: str) -> str:
    """The store key of a request: its rollout_id, else its `user` field, else its request id; validated."""
    if rollout_id is not None:
        return validate_rollout_id(rollout_id)
    if user is not None:
        return validate_rollout_id(user, "user (the rollout id of a request without rollout_id)")
    return validate_rollout_id(request_id, "request id (the rollout id of a request without rollout_id or user)")


def choice_rollout_id(rollout_id: str, index: int, n: int) -> str:
    """The id under which choice `index` of an `n`-choice request is stored."""
    return rollout_id if n == 1 else f"{rollout_id}_{index}"


def any_n_rollout_ids(rollout_id: str) -> list[str]:
    """Every id a request with this rollout id may have stored under, whatever its n."""
    return [rollout_id] + [f"{rollout_id}_{i}" for i in range(MAX_CHOICES)]


def previous_turn_rollout_id(rollout_id: str) -> str | None:
    """For `data:gen:turn:segment` with turn > 0, the same segment of the previous turn; else None.

    Other forms are left alone (None): only ids that parse with int() are multi-turn ids.
    """
    parts = rollout_id.rsplit(":", 2)
    if len(parts) != 3 or ":" not in parts[0]:
        return None
    prefix, turn_s, segment_s = parts
    try:
        turn, segment = int(turn_s), int(segment_s)
    except ValueError:
        return None
    if turn <= 0 or segment < 0:
        return None
    return f"{prefix}:{turn - 1}:{segment_s}"
