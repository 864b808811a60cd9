"""capabilities.has_capability: CapEff's bits, read from a status file."""

from fsmount import capabilities, mount, residency
from fsmount.capabilities import CAP_FOWNER, CAP_SYS_ADMIN, has_capability


def _status(tmp_path, cap_eff: str | None):
    path = tmp_path / "status"
    lines = ["Name:\tpython3", "Uid:\t1000\t1000\t1000\t1000"]
    if cap_eff is not None:
        lines.append(f"CapEff:\t{cap_eff}")
    lines.append("CapBnd:\t000001ffffffffff")
    path.write_text("\n".join(lines) + "\n")
    return str(path)


def test_each_bit_is_read_from_cap_eff_alone(tmp_path):
    only_sys_admin = _status(tmp_path, f"{1 << CAP_SYS_ADMIN:016x}")
    assert has_capability(CAP_SYS_ADMIN, only_sys_admin)
    assert not has_capability(CAP_FOWNER, only_sys_admin)
    both = _status(tmp_path, f"{1 << CAP_SYS_ADMIN | 1 << CAP_FOWNER:016x}")
    assert has_capability(CAP_FOWNER, both) and has_capability(CAP_SYS_ADMIN, both)
    # CapBnd has every bit: not the effective set.
    assert not has_capability(CAP_FOWNER, _status(tmp_path, "0000000000000000"))


def test_a_set_that_cannot_be_read_holds_nothing(tmp_path):
    assert not has_capability(CAP_FOWNER, _status(tmp_path, None))
    assert not has_capability(CAP_FOWNER, _status(tmp_path, "not-hex"))
    assert not has_capability(CAP_FOWNER, _status(tmp_path, ""))
    assert not has_capability(CAP_FOWNER, str(tmp_path / "missing"))


def test_the_callers_ask_their_own_capability(tmp_path, monkeypatch):
    """mount.mounts_by_itself asks CAP_SYS_ADMIN, residency.may_ask CAP_FOWNER, each for another uid than its own."""
    monkeypatch.setattr(mount.os, "geteuid", lambda: 1000)
    monkeypatch.setattr(residency.os, "geteuid", lambda: 1000)
    only_sys_admin = _status(tmp_path, f"{1 << CAP_SYS_ADMIN:016x}")
    assert mount.mounts_by_itself(only_sys_admin)
    assert not residency.may_ask(0, only_sys_admin)
    assert residency.may_ask(1000, only_sys_admin)
    only_fowner = _status(tmp_path, f"{1 << CAP_FOWNER:016x}")
    assert not mount.mounts_by_itself(only_fowner)
    assert residency.may_ask(0, only_fowner)
    assert capabilities.CAP_SYS_ADMIN == 21 and capabilities.CAP_FOWNER == 3
