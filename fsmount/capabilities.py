"""Which of capabilities(7) this process holds: the bits of /proc/self/status's CapEff, for the few places where
what the kernel allows depends on one (libfuse mounting with mount(2) itself; mincore telling the truth about a
file another user owns)."""

from __future__ import annotations

# Bits of CapEff (linux/capability.h).
CAP_FOWNER = 3
CAP_SYS_ADMIN = 21


def has_capability(bit: int, status: str = "/proc/self/status") -> bool:
    """Whether capability `bit` is in this process's effective set; False where the set cannot be read."""
    try:
        with open(status) as f:
            for line in f:
                if line.startswith("CapEff:"):
                    return bool(int(line.split()[1], 16) >> bit & 1)
    except (OSError, ValueError, IndexError):
        return False
    return False
