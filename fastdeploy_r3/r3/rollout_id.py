"""Rollout ids: the keys R3 is stored under (DESIGN.md §7), and the one rule that picks them.

    rollout_id of the request  >  its `user` field (as FastDeploy keys it)  >  its request id

Never a constant: two requests without ids must not overwrite each other's R3.

What an id may hold, and why no id can reach another one's entries (issue 11, F5-F7):

    rollout id   [A-Za-z0-9._:-], 1..MAX_ROLLOUT_ID_BYTES  `:` stays for `data:gen:turn:segment`
    choice id    {rollout_id}#{i} for choice i when n > 1    `#` is in no rollout id, so `coll#0`
                                                            (coll, n=2) is never `coll_0`'s (n=1) key
    namespace    [A-Za-z0-9._-], 1..64                      no `:` or `/`, the stores' separators

The byte bound leaves room, under the 255-byte file-name limit of every common file system, for the
`#63` of a choice, the `.npy` or `.layers` of the local store and the `.tmp.<pid>.<hex>` of its
atomic writes. The stores build keys from these parts with separators that none of them can hold
(r3/stores/), so a rollout id can neither reach the KV tier's keys (`fdr3:kv:...`) nor another
deployment's namespace nor another layer's entry.
"""

from __future__ import annotations

import re

# 255 - len("#63") - len(".layers") - len(".tmp.4194304.") - 8 hex digits = 224; round down for margin
MAX_ROLLOUT_ID_BYTES = 200
MAX_NAMESPACE_BYTES = 64
CHOICE_SEPARATOR = "#"

_ROLLOUT_ID_RE = re.compile(rf"[A-Za-z0-9._:-]{{1,{MAX_ROLLOUT_ID_BYTES}}}")
_NAMESPACE_RE = re.compile(rf"[A-Za-z0-9._-]{{1,{MAX_NAMESPACE_BYTES}}}")

# Most choices one request may have (the API server caps n here). only_last_turn deletes the previous
# turn's entries for every n up to this, because that turn may have had a different n than this one.
MAX_CHOICES = 64


class InvalidRolloutIdError(ValueError):
    """A rollout id (or namespace) that cannot be used as a store key or file name."""


class RolloutIdConflictError(ValueError):
    """A rollout id that is in flight, or already stored, and the request did not ask to overwrite it."""


def validate_rollout_id(rollout_id: str, what: str = "rollout_id") -> str:
    """Return `rollout_id` if it is `[A-Za-z0-9._:-]{1,200}` and not a path component like `..`."""
    if not isinstance(rollout_id, str) or not _ROLLOUT_ID_RE.fullmatch(rollout_id):
        shown = rollout_id if not isinstance(rollout_id, str) or len(rollout_id) <= 80 else f"{rollout_id[:40]}..."
        length = f" ({len(rollout_id)} characters)" if isinstance(rollout_id, str) else ""
        raise InvalidRolloutIdError(
            f"{what} {shown!r}{length} is invalid; use 1-{MAX_ROLLOUT_ID_BYTES} characters from "
            "[A-Za-z0-9._:-] (no path separators)"
        )
    if set(rollout_id) == {"."}:
        # only dots would name the store directory or its parent in local mode
        raise InvalidRolloutIdError(f"{what} {rollout_id!r} is invalid; it must not consist of dots only")
    return rollout_id


def validate_namespace(namespace: str, what: str = "namespace") -> str:
    """Return `namespace` if it is `[A-Za-z0-9._-]{1,64}`: no `:` or `/`, so it cannot run into a key."""
    if not isinstance(namespace, str) or not _NAMESPACE_RE.fullmatch(namespace) or set(namespace) == {"."}:
        raise InvalidRolloutIdError(
            f"{what} {namespace!r} is invalid; use 1-{MAX_NAMESPACE_BYTES} characters from [A-Za-z0-9._-] "
            "(not only dots; no ':' or '/', which separate the parts of a store key)"
        )
    return namespace


def resolve_rollout_id(rollout_id: str | None, user: str | None, request_id: str) -> str:
    """The store key of a request: its rollout_id, else its `user` field, else its request id; validated."""
    if rollout_id is not None:
        return validate_rollout_id(rollout_id)
    if user is not None:
        return validate_rollout_id(user, "user (the rollout id of a request without rollout_id)")
    return validate_rollout_id(request_id, "request id (the rollout id of a request without rollout_id or user)")


def choice_rollout_id(rollout_id: str, index: int | None) -> str:
    """The id choice `index` of a request with n > 1 is stored under, `{rollout_id}#{index}`; the
    rollout id itself for None (the one choice of an n = 1 request)."""
    return rollout_id if index is None else f"{rollout_id}{CHOICE_SEPARATOR}{index}"


def any_n_rollout_ids(rollout_id: str) -> list[str]:
    """Every id a request with this rollout id may have stored under, whatever its n."""
    return [rollout_id] + [f"{rollout_id}{CHOICE_SEPARATOR}{i}" for i in range(MAX_CHOICES)]


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
