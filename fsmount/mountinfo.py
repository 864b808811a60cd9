"""/proc/self/mountinfo, read: every mount's ids, device, mount point (unescaped), type and options, as bytes, and
which of several mounts at one mount point is the one on top. Used by `mount`, `prefetch_command`, `mount_users`."""

from __future__ import annotations

import re
from dataclasses import dataclass

MOUNTINFO = "/proc/self/mountinfo"
# mountinfo writes a space, tab, newline and backslash of a path as \ooo (octal); every other byte as it is.
ESCAPE = re.compile(rb"\\([0-7]{3})")


@dataclass(frozen=True)
class Mount:
    """One line of mountinfo, as bytes: a path there that is not UTF-8, this one's or any other mount's, raised a
    UnicodeDecodeError out of the daemon's stop (B121)."""

    mount_id: bytes
    parent: bytes
    device: bytes  # major:minor
    point: bytes  # unescaped
    fstype: bytes
    options: bytes  # the super block's options (a FUSE mount's user_id=, allow_other)


def unescaped(field: bytes) -> bytes:
    """A path as mountinfo writes it (space, tab, newline and backslash as octal escapes), unescaped."""
    return ESCAPE.sub(lambda m: bytes([int(m[1], 8)]), field)


def mounts(mountinfo: str = MOUNTINFO) -> list[Mount]:
    """Every mount in `mountinfo`, in its order (the order they were made, not their stacking)."""
    with open(mountinfo, "rb") as f:
        return [Mount(fields[0], fields[1], fields[2], unescaped(fields[4]), fields[fields.index(b"-") + 1],
                      fields[-1]) for fields in map(bytes.split, f)]


def on_top(listed: list[Mount]) -> list[Mount]:
    """The mounts of `listed` that no other mount at their mount point sits on: of several at one path, the one on
    top, the one a path there reaches. Not the last listed there: mountinfo lists mounts in the order they were made,
    so one made earlier and moved over another (mount(8)'s move) comes before it (B510); a mount over another has the
    other's mount id for its parent."""
    under = {(m.point, m.parent) for m in listed}
    return [m for m in listed if (m.point, m.mount_id) not in under]


def stacked(point: bytes, listed: list[Mount]) -> list[Mount]:
    """The mounts of `listed` at exactly `point`, from the bottom one up (each one's parent the one below it)."""
    here = [m for m in listed if m.point == point]
    ids = {m.mount_id for m in here}
    stack = [m for m in here if m.parent not in ids][-1:]
    while stack and len(stack) < len(here):
        above = [m for m in here if m.parent == stack[-1].mount_id]
        if not above:
            break
        stack.append(above[-1])
    return stack


def top_at(point: bytes, listed: list[Mount]) -> Mount | None:
    """The mount on top at exactly `point`, or None where nothing is mounted there."""
    stack = stacked(point, listed)
    return stack[-1] if stack else None


def holding(path: bytes, listed: list[Mount]) -> Mount | None:
    """The mount a resolved absolute `path` lies on: the deepest mount point at or above it, the one on top there."""
    best = None
    for m in on_top(listed):
        if (path == m.point or path.startswith(m.point.rstrip(b"/") + b"/")) and \
                (best is None or len(m.point) >= len(best.point)):
            best = m
    return best
