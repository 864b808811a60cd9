"""/proc/self/mountinfo, read: every mount's ids, device, mount point (unescaped), type and options, as bytes, and
which mount a path reaches: of several at one mount point the one on top, never one hidden under a mount made over a
directory above it. Used by `mount`, `prefetch_command`, `mount_users`."""

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
    """The mount on top at exactly `point`, the one a path there reaches (`holding`), or None where nothing reachable
    is mounted there (nothing, or only mounts hidden under a mount over a directory above them)."""
    on = holding(point, listed)
    return on if on is not None and on.point == point else None


def holding(path: bytes, listed: list[Mount]) -> Mount | None:
    """The mount a resolved absolute `path` lies on, found as the kernel walks it: from the root mount (one whose
    parent is not listed), into the mount on the first directory of the path that has one, and so on; a mount over
    another at one path has the other's id for its parent, and is crossed into first. Not the deepest mount point at
    or above the path: a mount made on a directory of a mount that another mount was later made over (/models/sub of
    a mount at /models covered since) is hidden, and the path reaches the mount over it (B620). Of mounts on one
    directory of one mount, the last listed."""
    ids = {m.mount_id for m in listed}
    children: dict[bytes | None, list[Mount]] = {}
    for m in listed:
        children.setdefault(m.parent if m.parent in ids and m.parent != m.mount_id else None, []).append(m)
    at: Mount | None = None
    seen: set[bytes] = set()
    while True:
        here = [m for m in children.get(None if at is None else at.mount_id, ())
                if m.mount_id not in seen and (path == m.point or path.startswith(m.point.rstrip(b"/") + b"/"))]
        if not here:
            return at
        first = min(len(m.point) for m in here)  # the directory the walk reaches first
        at = [m for m in here if len(m.point) == first][-1]
        seen.add(at.mount_id)
