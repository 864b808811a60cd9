"""What memory the daemon may use, read from fake /proc and cgroup trees: cgroup v1 and v2, limits of the
cgroups above, a container's view of the hierarchy, no limit, and unreadable files."""

from __future__ import annotations

from pathlib import Path

import pytest

from fsmount import sysmem

MiB = 1 << 20
V1_UNLIMITED = "9223372036854771712"


def write(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)


def v2_tree(tmp_path: Path, cgroup: str, root: str = "/", mount_at: str = "sys fs/cgroup") -> tuple[Path, Path]:
    """/proc/self of a process in `cgroup` of a cgroup2 hierarchy mounted (with root `root`) at `mount_at`."""
    proc = tmp_path / "proc"
    mount = tmp_path / mount_at
    write(proc / "cgroup", f"0::{cgroup}\n")
    escaped = str(mount).replace(" ", "\\040")
    write(proc / "mountinfo", f"24 30 0:22 / /proc rw - proc proc rw\n"
                              f"35 24 0:30 {root} {escaped} rw,nosuid - cgroup2 cgroup2 rw,nsdelegate\n")
    return proc, mount


def v2_group(d: Path, limit: str, current: int, file: int = 0) -> None:
    write(d / "memory.max", limit + "\n")
    write(d / "memory.current", f"{current}\n")
    write(d / "memory.stat", f"anon {current - file}\nfile {file}\ninactive_file {file // 2}\n"
                             f"active_file {file - file // 2}\n")


def test_cgroup_v2_limit_free_and_available(tmp_path: Path) -> None:
    proc, mount = v2_tree(tmp_path, "/kubepods/pod1/ctr")
    v2_group(mount / "kubepods/pod1/ctr", "max", 300 * MiB, file=200 * MiB)
    v2_group(mount / "kubepods/pod1", str(900 * MiB), 700 * MiB, file=500 * MiB)
    v2_group(mount / "kubepods", "max", 5000 * MiB)
    cg = sysmem.cgroup_memory(proc)
    # The pod's limit binds; its page cache counts as available, not as free.
    assert cg == sysmem.CgroupMemory(limit=900 * MiB, available=700 * MiB, free=200 * MiB)


def test_the_tightest_cgroup_on_the_way_up_binds(tmp_path: Path) -> None:
    proc, mount = v2_tree(tmp_path, "/a/b")
    v2_group(mount / "a/b", str(2000 * MiB), 100 * MiB)
    v2_group(mount / "a", str(1000 * MiB), 950 * MiB, file=450 * MiB)  # a sibling of b uses the rest
    cg = sysmem.cgroup_memory(proc)
    assert cg is not None and (cg.limit, cg.available, cg.free) == (1000 * MiB, 500 * MiB, 50 * MiB)


def test_a_container_sees_its_own_cgroup_as_the_root_of_the_mount(tmp_path: Path) -> None:
    """With a cgroup namespace the path reads "/"; without one, the mount's root is stripped from it."""
    proc, mount = v2_tree(tmp_path, "/", root="/kubepods/pod1")
    v2_group(mount, str(512 * MiB), 100 * MiB)
    assert sysmem.cgroup_memory(proc).limit == 512 * MiB
    proc, mount = v2_tree(tmp_path / "x", "/kubepods/pod1/ctr", root="/kubepods/pod1")
    v2_group(mount / "ctr", str(256 * MiB), 10 * MiB)
    v2_group(mount, str(512 * MiB), 10 * MiB)
    assert sysmem.cgroup_memory(proc).limit == 256 * MiB


def test_cgroup_v1_memory_hierarchy(tmp_path: Path) -> None:
    proc = tmp_path / "proc"
    mount = tmp_path / "sys/fs/cgroup/memory"
    write(proc / "cgroup", "5:cpu,cpuacct:/x\n4:memory:/process_api/abc\n0::/\n")
    write(proc / "mountinfo", f"40 30 0:33 / {tmp_path}/sys/fs/cgroup/cpu rw - cgroup cgroup rw,cpu,cpuacct\n"
                              f"41 30 0:34 / {mount} rw - cgroup cgroup rw,memory\n"
                              f"42 30 0:35 / {tmp_path}/sys/fs/cgroup/unified rw - cgroup2 cgroup2 rw\n")
    leaf = mount / "process_api/abc"
    write(leaf / "memory.limit_in_bytes", f"{900 * MiB}\n")
    write(leaf / "memory.usage_in_bytes", f"{880 * MiB}\n")
    write(leaf / "memory.stat", f"cache 1\ninactive_file 1\ntotal_inactive_file {300 * MiB}\n"
                                f"total_active_file {200 * MiB}\n")
    for d in (mount / "process_api", mount):
        write(d / "memory.limit_in_bytes", V1_UNLIMITED + "\n")
        write(d / "memory.usage_in_bytes", f"{4000 * MiB}\n")
    cg = sysmem.cgroup_memory(proc)
    assert cg == sysmem.CgroupMemory(limit=900 * MiB, available=520 * MiB, free=20 * MiB)


@pytest.mark.parametrize("broken", ["no cgroup file", "no mount", "no limit", "garbage"])
def test_no_limit_where_nothing_readable_says_one(tmp_path: Path, broken: str) -> None:
    proc, mount = v2_tree(tmp_path, "/a")
    v2_group(mount / "a", str(100 * MiB), MiB)
    if broken == "no cgroup file":
        (proc / "cgroup").unlink()
    elif broken == "no mount":
        write(proc / "mountinfo", "24 30 0:22 / /proc rw - proc proc rw\n")
    elif broken == "no limit":
        write(mount / "a/memory.max", "max\n")
    else:
        write(mount / "a/memory.max", "lots\n")
    assert sysmem.cgroup_memory(proc) is None


def test_ram_available_and_free_take_the_lower_of_machine_and_cgroup(tmp_path: Path, monkeypatch) -> None:  # noqa: ANN001
    proc, mount = v2_tree(tmp_path, "/a")
    v2_group(mount / "a", str(900 * MiB), 400 * MiB, file=300 * MiB)
    meminfo = tmp_path / "meminfo"
    write(meminfo, "MemTotal:  16000000 kB\nMemFree:  40960 kB\nMemAvailable:  8000000 kB\n")
    monkeypatch.setattr(sysmem, "physical_ram", lambda: 16 << 30)
    assert sysmem.ram(proc) == 900 * MiB
    assert sysmem.available(proc, meminfo) == 800 * MiB
    assert sysmem.free(proc, meminfo) == 40 * MiB  # the machine has less free than the cgroup
    unlimited, mount = v2_tree(tmp_path / "other", "/b")
    v2_group(mount / "b", "max", 400 * MiB)
    assert sysmem.ram(unlimited) == 16 << 30
    assert sysmem.available(unlimited, meminfo) == 8000000 * 1024


def test_the_default_memory_limit_is_a_tenth_of_the_cgroup_s(monkeypatch) -> None:  # noqa: ANN001
    """In a pod of 900 MiB the default was 2 GiB, and the cgroup killed the daemon (OOM) during a load."""
    import fsmount.config

    monkeypatch.setattr(fsmount.config, "usable_ram", lambda: 900 * MiB)
    assert fsmount.config.default_memory_limit() == 90 * MiB
    monkeypatch.setattr(fsmount.config, "usable_ram", lambda: 64 << 30)
    assert fsmount.config.default_memory_limit() == fsmount.config.MEMORY_LIMIT_CAP
    monkeypatch.setattr(fsmount.config, "usable_ram", lambda: None)
    assert fsmount.config.default_memory_limit() == fsmount.config.MEMORY_LIMIT_CAP


def test_the_default_memory_limit_is_a_quarter_of_a_limited_address_space() -> None:
    """At `ulimit -v 600000` the 2 GiB default failed fetches with ENOMEM, and an mmap loader died of SIGBUS."""
    import subprocess
    import sys

    code = ("import resource; resource.setrlimit(resource.RLIMIT_AS, (600000 * 1024, resource.RLIM_INFINITY)); "
            "import fsmount.config as c; c.usable_ram = lambda: 64 << 30; print(c.default_memory_limit())")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert int(out) == 600000 * 1024 // 4
