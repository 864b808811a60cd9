"""Differential fuzzing of the namespace through a real mount while another writer changes the bucket: seeded random
sequences, each step either a change made straight to the bucket (boto3) or an operation through the mount, every
answer checked against a model of the bucket's history and the README's consistency promises.

The other writer puts new files (nested ones, names with spaces, unicode, `+` and `=`), overwrites one at the same size
or another size, deletes a file or a whole prefix, puts a directory marker (`dir/`), and makes a file's name also a
directory prefix (`x` and `x/y`: the directory wins). Through the mount: stat/lstat, listdir/scandir (names and
types), open and read a file whole, reads through a handle opened before the changes, chdir and relative operations,
`os.walk`, listings through a directory descriptor opened earlier (`os.scandir(fd)`), opens of names just deleted, and
reads of a file while the other writer rewrites it over and over (the one step that runs alongside a change).

The model (README "Semantics", namespace.py's docstring): the bucket's states in order, each with the span of time it
may have been what a request saw. An answer about a path during an operation that ran [t0, t1] is what some state
seen in [t0 - TTL - slack, t1] says of it (old or new within the TTL; with TTL 0 only what the bucket held during the
operation; with `forever` any state since the mount began); after a pause of a TTL and the slack every answer is the
current state's. A listing is one state's names and types. Bytes read are always one whole version's. A handle keeps
reading the version it opened, or fails with EIO once that version is gone; a read of a path the bucket changed
within the window may fail with EIO too (a version found gone); any other error is ENOENT or ENOTDIR, as the state
says. After a read found its version gone, the next open of the path gets what the bucket holds now, even with
`forever`. A failure names the seed and the steps that led to it; `MODELFS_FUZZ_RUNS=N` runs N seeds per test,
`MODELFS_FUZZ_SEED_SHIFT=N` moves each test's first seed on by N.
"""

from __future__ import annotations

import errno
import os
import random
import stat
import threading
import time
from collections.abc import Callable, Iterable
from pathlib import Path

import pytest

from tests.helpers import FETCH_FAILED, READ_FAILED, S3Server, delete_bucket, mounted, new_bucket, random_bytes

RUNS = int(os.environ.get("MODELFS_FUZZ_RUNS", "1"))
STEPS = int(os.environ.get("MODELFS_FUZZ_STEPS", "0"))
SHIFT = int(os.environ.get("MODELFS_FUZZ_SEED_SHIFT", "0"))  # moves each first seed on (as in test_read_fuzz.py)
# Timer slack on top of the TTL: the kernel's entry timeouts are in jiffies, a listing's TTL counts from its start.
SLACK_S = 0.3
MAX_SIZE = 3000
# Rewrites of one file while the mount reads it (`op_race`), and the most reads meanwhile.
RACE_PUTS = 8
RACE_READS = 30
# Keys the other writer uses. Every segment is a name the kernel can represent (no empty ones).
FILES = ("a", "b c.bin", "ü+=.txt", "d/x", "d/e f", "d/g+h=", "n/a/b/c", "n/a/z", "m/k", "x", "x/y")
# Directory markers it may put.
MARKERS = ("m/", "e/", "d/")
# Prefixes it may delete whole.
PREFIXES = ("d/", "n/", "n/a/", "x/", "m/")
# Paths the mount is asked about: the files, their directories and a name never stored.
DIRS = ("", "d", "n", "n/a", "n/a/b", "m", "e", "x")
PATHS = (*FILES, *(d for d in DIRS if d), "nothing", "x/y/z", "a/under")
# What the daemon says when a read finds its version gone (replaced: 412, deleted: 404).
ALLOWED = (FETCH_FAILED, READ_FAILED, r"object changed", r"not found")

State = dict[str, bytes]
# What a state says of a path: ("dir",), ("file", bytes), ("absent",) or ("notdir",) (a file on the way); and what the
# mount answered: those, ("size", st_size) of a stat, ("listing", names and types), ("error", errno name).
Seen = tuple


def is_dir(state: State, path: str) -> bool:
    return path == "" or any(k.startswith(path + "/") for k in state)


def observe(state: State, path: str) -> Seen:
    """What `state` says is at `path`, walking from the root as the kernel does."""
    parts = path.split("/") if path else []
    for i in range(len(parts) - 1):
        above = "/".join(parts[:i + 1])
        if is_dir(state, above):
            continue
        return ("notdir",) if above in state else ("absent",)
    if is_dir(state, path):
        return ("dir",)
    return ("file", state[path]) if path in state else ("absent",)


def children(state: State, path: str) -> frozenset[tuple[str, bool]]:
    """A listing of `path` in `state`: (name, is a directory); a directory wins over a file of the same name."""
    prefix = path + "/" if path else ""
    names: dict[str, bool] = {}
    for key in state:
        if not key.startswith(prefix) or key == prefix:
            continue
        rest = key[len(prefix):]
        name, sep, _ = rest.partition("/")
        names[name] = names.get(name, False) or bool(sep)
    return frozenset(names.items())


def outcome(exc: OSError) -> Seen:
    if exc.errno == errno.ENOENT:
        return ("absent",)
    if exc.errno == errno.ENOTDIR:
        return ("notdir",)
    return ("error", errno.errorcode.get(exc.errno, exc.errno))


class Fuzz:
    def __init__(self, s3: S3Server, bucket: str, root: Path, seed: int, history: list[tuple[float, float, State]], *,
                 ttl: float, seaweedfs: bool):
        self.s3, self.client, self.bucket, self.root = s3, s3.client(), bucket, root
        self.rng = random.Random(seed)
        self.seed, self.ttl = seed, ttl
        # SeaweedFS keeps a file and a directory of one name apart: `x` beside `x/y` only elsewhere.
        self.conflicts = not seaweedfs
        # SeaweedFS keeps a folder whose keys were all deleted (not one whose marker was deleted), and its delimited
        # listings name it, a common prefix with no key under it; lookups list delimited too (B61): such a directory
        # may show, empty, or not, as the keys that made it went. The directories any state had, for that.
        self.folders_stay = seaweedfs
        self.ever_dirs: set[str] = set()
        for _, _, state in history:
            self.note_dirs(state)
        # The bucket's states in order since the mount began: (seen from, seen until, keys and bytes). A state may be
        # what a request saw from just before the change that made it until just after the next change.
        self.states = history
        self.counter = 0
        self.log: list[str] = []
        self.held: list[tuple[int, str, list[bytes]]] = []  # fd, path, the versions it may read (narrowed)
        # fd, path, the span of the states its listing may be of, whether it was read
        self.dir_fds: list[tuple[int, str, float, float, bool]] = []
        self.ran: dict[str, int] = {}
        self.chosen: set[str] = set()  # the operations a run may choose

    # -- the model ----------------------------------------------------------------------------------

    @property
    def now(self) -> State:
        return self.states[-1][2]

    def window(self, t0: float, t1: float, since: float | None = None) -> list[State]:
        """The states an answer during [t0, t1] may come from: those seen in [t0 - TTL - slack, t1] (or from
        `since`)."""
        start = t0 - self.ttl - SLACK_S if since is None else since
        return [s for seen_from, seen_until, s in self.states if seen_until >= start and seen_from <= t1]

    def fail(self, what: str) -> None:
        recent = "\n  ".join(self.log[-30:])
        pytest.fail(f"seed {self.seed} (TTL {self.ttl:g}): {what}\n the bucket now: "
                    f"{ {k: len(v) for k, v in sorted(self.now.items())} }\n last steps:\n  {recent}")

    def allowed(self, states: list[State], path: str) -> set[Seen]:
        """What a lookup of `path` may answer: what one state says, or the last name of the path as one state has it
        with the directories above it as another had them (the kernel's entries are of different ages)."""
        seen = {observe(s, path) for s in states}
        if self.ghost(path) and not any(observe(s, path)[0] == "file" for s in states):
            seen.add(("dir",))
        parts = path.split("/") if path else []
        for i in range(len(parts) - 1):
            above = "/".join(parts[:i + 1])
            seen |= {observe(s, above) for s in states} & {("absent",)}
            seen |= {("notdir",) for s in states if observe(s, above)[0] == "file"}
        if all(any(is_dir(s, "/".join(parts[:i + 1])) for s in states) for i in range(len(parts) - 1)):
            seen |= {observe(s, path) if is_dir(s, path) or path in s else ("absent",) for s in states}
        return seen

    def dir_errors(self, states: list[State], path: str) -> set[Seen]:
        """What opening `path` as a directory may fail with: ENOENT, or ENOTDIR where a state has a file there."""
        return {("notdir",) if s[0] in ("file", "notdir") else s for s in self.allowed(states, path) if s[0] != "dir"}

    def changed_in(self, states: list[State], path: str) -> bool:
        """Whether `path` is not the same in all of `states` (a read of it may then find its version gone)."""
        return len({observe(s, path) for s in states}) > 1

    def ghost(self, path: str) -> bool:
        """Whether `path` may be a folder SeaweedFS kept, all its keys deleted."""
        return self.folders_stay and path in self.ever_dirs

    def check(self, what: str, got: Seen, allowed: Iterable[Seen], listed: str | None = None) -> None:
        """`got` is one of `allowed`; a listing of `listed` may also name folders SeaweedFS kept."""
        allowed = list(allowed)

        def with_folders_kept(listing: Seen) -> bool:
            return listing[0] == "listing" and listing[1] <= got[1] and all(
                is_dir and self.ghost(join(listed or "", name)) for name, is_dir in got[1] - listing[1])
        if got in allowed or (self.folders_stay and got[0] == "listing" and any(map(with_folders_kept, allowed))):
            return

        def short(s: Seen) -> object:
            return ("file", len(s[1]), s[1][:8]) if s[0] == "file" and isinstance(s[1], bytes) else s
        self.fail(f"{what}: got {short(got)}, allowed {[short(a) for a in allowed]}")

    # -- changes by the other writer ------------------------------------------------------------------

    def change(self, what: str, apply: Callable[[State], None], request: Callable[[], object]) -> None:
        new = dict(self.now)
        apply(new)
        t0 = time.monotonic()
        request()
        t1 = time.monotonic()
        self.note_dirs(new)
        seen_from, _, old = self.states[-1]
        self.states[-1] = (seen_from, t1, old)
        self.states.append((t0, float("inf"), new))
        self.log.append(f"bucket: {what}")

    def note_dirs(self, state: State) -> None:
        for key in state:
            parts = key.split("/")[:-1]
            self.ever_dirs |= {"/".join(parts[:i + 1]) for i in range(len(parts))}

    def body(self, size: int) -> bytes:
        self.counter += 1
        return random_bytes(size, self.seed * 100_000 + self.counter)

    def put(self, key: str, data: bytes) -> None:
        def apply(s: State) -> None:
            s[key] = data
        self.change(f"put {key!r} ({len(data)} bytes)", apply,
                    lambda: self.client.put_object(Bucket=self.bucket, Key=key, Body=data))

    def delete(self, keys: list[str], what: str) -> None:
        def apply(s: State) -> None:
            for k in keys:
                s.pop(k, None)
        if keys:
            self.change(what, apply, lambda: self.client.delete_objects(
                Bucket=self.bucket, Delete={"Objects": [{"Key": k} for k in keys], "Quiet": True}))

    def ch_put_new(self) -> None:
        files = [f for f in FILES if self.conflicts or f not in ("x", "x/y")]
        self.put(self.rng.choice(files), self.body(self.rng.randrange(MAX_SIZE)))

    def ch_overwrite(self) -> None:
        stored = sorted(k for k in self.now if not k.endswith("/"))
        if not stored:
            return self.ch_put_new()
        key = self.rng.choice(stored)
        same = self.rng.random() < 0.5
        self.put(key, self.body(len(self.now[key]) if same else self.rng.randrange(MAX_SIZE)))
        self.maybe_read_at_once(key)

    def ch_delete(self) -> None:
        stored = sorted(self.now)
        if stored:
            key = self.rng.choice(stored)
            self.delete([key], f"delete {key!r}")
            self.maybe_read_at_once(key)

    def ch_delete_prefix(self) -> None:
        prefix = self.rng.choice(PREFIXES)
        self.delete(sorted(k for k in self.now if k.startswith(prefix)), f"delete prefix {prefix!r}")

    def ch_marker(self) -> None:
        self.put(self.rng.choice(MARKERS), b"")

    def ch_file_and_prefix(self) -> None:
        """`x` and `x/y` at once: the directory wins, the file is hidden (README "Semantics")."""
        if not self.conflicts:
            return self.ch_put_new()
        self.put("x" if "x/y" in self.now else "x/y", self.body(self.rng.randrange(1, MAX_SIZE)))

    def maybe_read_at_once(self, key: str) -> None:
        """Sometimes open a name just changed or deleted, before the TTL can have passed."""
        if self.rng.random() < 0.5:
            self.read_whole(key.rstrip("/"))

    # -- operations through the mount -----------------------------------------------------------------

    def timed(self, fn: Callable[[], Seen]) -> tuple[Seen, float, float]:
        t0 = time.monotonic()
        try:
            got = fn()
        except OSError as exc:
            got = outcome(exc)
        return got, t0, time.monotonic()

    def target(self, path: str, cwd: str | None) -> Path:
        """`path` as the mount's path, or relative to the working directory `cwd` (a path of the mount)."""
        if cwd is None:
            return self.root / path
        return Path(path[len(cwd) + 1:] if cwd else path)

    def stat_path(self, path: str, *, follow: bool = True, cwd: str | None = None) -> None:
        target = self.target(path, cwd)

        def probe() -> Seen:
            st = os.stat(target) if follow else os.lstat(target)
            return ("dir",) if stat.S_ISDIR(st.st_mode) else ("size", st.st_size)
        got, t0, t1 = self.timed(probe)
        allowed = {("size", len(s[1])) if s[0] == "file" else s for s in self.allowed(self.window(t0, t1), path)}
        what = f"{'stat' if follow else 'lstat'} {str(target)!r}"
        self.log.append(f"{what} -> {got}")
        self.check(what, got, allowed)

    def op_stat(self) -> None:
        self.stat_path(self.rng.choice(PATHS), follow=self.rng.random() < 0.5)

    def listing(self, what: str, path: str, list_it: Callable[[], frozenset]) -> None:
        got, t0, t1 = self.timed(lambda: ("listing", list_it()))
        states = self.window(t0, t1)
        allowed: set[Seen] = {("listing", children(s, path)) for s in states}
        allowed |= self.dir_errors(self.window(t0, t1), path)
        self.log.append(f"{what} {path!r} -> {sorted(got[1]) if got[0] == 'listing' else got}")
        self.check(f"{what} {path!r}", got, allowed, listed=path)

    def op_listdir(self) -> None:
        path = self.rng.choice(DIRS)
        if self.rng.random() < 0.5:
            # listdir has no types: names alone are compared, each marked as a folder SeaweedFS may have kept or not.
            def names() -> frozenset:
                return frozenset((n, self.ghost(join(path, n))) for n in os.listdir(self.root / path))
            got, t0, t1 = self.timed(lambda: ("listing", names()))
            allowed = {("listing", frozenset((n, n_is_dir and self.ghost(join(path, n))) for n, n_is_dir in
                                             children(s, path))) for s in self.window(t0, t1)}
            allowed |= self.dir_errors(self.window(t0, t1), path)
            self.log.append(f"listdir {path!r} -> {got}")
            self.check(f"listdir {path!r}", got, allowed, listed=path)
        else:
            self.listing("scandir", path, lambda: scan(self.root / path))

    def read_whole(self, path: str, cwd: str | None = None) -> None:
        target = self.target(path, cwd)
        got, t0, t1 = self.timed(lambda: read_path(target))
        states = self.window(t0, t1)
        self.log.append(f"read {str(target)!r} -> {got[0]} {len(got[1]) if got[0] == 'file' else got[1:]}")
        if got == ("error", "EIO") and self.changed_in(states, path):
            # A version found gone: the next open gets what the bucket holds now at the name, whatever the TTL (the
            # directories above it may be the kernel's older entries: a file deleted is ENOENT there).
            got, t0, t1 = self.timed(lambda: read_path(target))
            self.log.append(f"read {str(target)!r} again -> {got[0]} {len(got[1]) if got[0] == 'file' else got[1:]}")
            now = {observe(self.now, path)} | ({("absent",)} if path not in self.now else set())
            self.check(f"a read of {str(target)!r} after EIO", got, now)
            return
        self.check(f"read {str(target)!r}", got, self.allowed(states, path))

    def op_read(self) -> None:
        self.read_whole(self.rng.choice(PATHS))

    def op_open_held(self) -> None:
        path = self.rng.choice(FILES)
        t0 = time.monotonic()
        try:
            fd = os.open(self.root / path, os.O_RDONLY)
        except OSError as exc:
            got, t1 = outcome(exc), time.monotonic()
            self.log.append(f"open held {path!r} -> {got}")
            allowed = self.allowed(self.window(t0, t1), path)
            if got == ("error", "EIO") and self.changed_in(self.window(t0, t1), path):
                return
            return self.check(f"open {path!r}", got, allowed)
        t1 = time.monotonic()
        if stat.S_ISDIR(os.fstat(fd).st_mode):
            os.close(fd)
            self.log.append(f"open held {path!r} -> dir")
            return self.check(f"open {path!r}", ("dir",), self.allowed(self.window(t0, t1), path))
        versions = [s[path] for s in self.window(t0, t1) if observe(s, path)[0] == "file"]
        if not versions:
            os.close(fd)
            self.fail(f"open {path!r} opened a file no state of the window has there")
        self.held.append((fd, path, versions))
        self.log.append(f"open held {path!r} (fd {fd}, {len(versions)} candidate versions)")

    def op_read_held(self) -> None:
        if not self.held:
            return self.op_open_held()
        i = self.rng.randrange(len(self.held))
        fd, path, versions = self.held[i]
        try:
            size = os.fstat(fd).st_size
            got = read_all(fd)
        except OSError as exc:
            self.log.append(f"read held {path!r} (fd {fd}) -> {outcome(exc)}")
            if exc.errno == errno.EIO and any(v != self.now.get(path) for v in versions):
                return
            self.fail(f"read through a handle of {path!r}: {exc!r}")
        self.log.append(f"read held {path!r} (fd {fd}) -> {len(got)} bytes")
        if got not in versions:
            self.fail(f"read through a handle of {path!r}: {len(got)} bytes that are no version it may have opened "
                      f"(sizes {[len(v) for v in versions]})")
        if size != len(got):
            self.fail(f"fstat of a handle of {path!r}: size {size}, its version has {len(got)} bytes")
        self.held[i] = (fd, path, [got])  # its version, for good

    def op_close_held(self) -> None:
        if self.held:
            fd, path, _ = self.held.pop(self.rng.randrange(len(self.held)))
            os.close(fd)
            self.log.append(f"close held {path!r} (fd {fd})")

    def op_chdir(self) -> None:
        """chdir into a directory, then relative operations from there."""
        path = self.rng.choice(DIRS)
        before = os.getcwd()
        t0 = time.monotonic()
        try:
            os.chdir(self.root / path)
        except OSError as exc:
            got = outcome(exc)
            self.log.append(f"chdir {path!r} -> {got}")
            return self.check(f"chdir {path!r}", got, self.dir_errors(self.window(t0, time.monotonic()), path))
        try:
            self.log.append(f"chdir {path!r}")
            below = [p for p in PATHS if p.startswith(path + "/")] if path else list(PATHS)
            for _ in range(3):
                r = self.rng.random()
                if r < 0.3 or not below:
                    self.listing("scandir .", path, lambda: scan("."))
                elif r < 0.65:
                    self.stat_path(self.rng.choice(below), cwd=path)
                else:
                    self.read_whole(self.rng.choice(below), cwd=path)
        finally:
            os.chdir(before)

    def op_walk(self) -> None:
        t0 = time.monotonic()
        walked = list(os.walk(self.root))
        t1 = time.monotonic()
        self.log.append(f"walk -> {len(walked)} directories")
        states = self.window(t0, t1)
        for top, dirs, files in walked:
            path = os.path.relpath(top, self.root)
            path = "" if path == "." else path
            got = frozenset([(d, True) for d in dirs] + [(f, False) for f in files])
            self.check(f"walk's listing of {path!r}", ("listing", got),
                       {("listing", children(s, path)) for s in states}, listed=path)

    def op_open_dir_fd(self) -> None:
        path = self.rng.choice(DIRS)
        t0 = time.monotonic()
        try:
            fd = os.open(self.root / path, os.O_RDONLY | os.O_DIRECTORY)
        except OSError as exc:
            got = outcome(exc)
            self.log.append(f"opendir fd {path!r} -> {got}")
            return self.check(f"opendir {path!r}", got, self.dir_errors(self.window(t0, time.monotonic()), path))
        # The states its listing may be of (the cached listing it got may be a TTL old).
        self.dir_fds.append((fd, path, t0 - self.ttl - SLACK_S, time.monotonic(), False))
        self.log.append(f"opendir fd {path!r} (fd {fd})")

    def op_scan_dir_fd(self) -> None:
        """A listing through a directory descriptor opened earlier. Its first readdir lists what its opendir saw; each
        os.scandir(fd) after that starts with a rewind, which lists the directory again once the handle's listing is
        older than the TTL (else it keeps it)."""
        if not self.dir_fds:
            return self.op_open_dir_fd()
        i = self.rng.randrange(len(self.dir_fds))
        fd, path, lo, hi, read_before = self.dir_fds[i]
        got, t0, t1 = self.timed(lambda: ("listing", scan(fd)))
        if read_before and t0 - hi >= self.ttl + SLACK_S:
            lo = t0 - self.ttl - SLACK_S  # listed again: from the cache, or the bucket
            hi = t1
        elif read_before and t1 - lo >= self.ttl - SLACK_S:
            hi = t1  # listed again, or not
        self.dir_fds[i] = (fd, path, lo, hi, True)
        self.log.append(f"scandir(fd {fd}) {path!r} -> {sorted(got[1]) if got[0] == 'listing' else got}")
        self.check(f"scandir(fd {fd}) of {path!r}", got,
                   {("listing", children(s, path)) for s in self.window(lo, hi, since=lo)}, listed=path)

    def op_race(self) -> None:
        """The other writer rewrites a file over and over while the mount opens and reads it: each read is one whole
        version the bucket held meanwhile, or EIO (found replaced); never another error ("Stale file handle")."""
        key = self.rng.choice([f for f in FILES if self.conflicts or f not in ("x", "x/y")])
        bodies = [self.body(self.rng.randrange(MAX_SIZE)) for _ in range(RACE_PUTS)]
        writer = threading.Thread(target=lambda: [self.put(key, body) for body in bodies])
        reads: list[tuple[Seen, float, float]] = []
        writer.start()
        try:
            while (writer.is_alive() and len(reads) < RACE_READS) or not reads:
                reads.append(self.timed(lambda: read_path(self.root / key)))
        finally:
            writer.join()
        self.log.append(f"race on {key!r}: {[got[0] if got[0] != 'file' else len(got[1]) for got, _, _ in reads]}")
        for got, t0, t1 in reads:
            states = self.window(t0, t1)
            if got == ("error", "EIO") and self.changed_in(states, key):
                continue
            self.check(f"a read of {key!r} while it was rewritten", got, self.allowed(states, key))

    def op_wait_ttl(self) -> None:
        """Past a TTL with no change, every answer is the current state's."""
        if self.ttl == float("inf"):
            return self.op_walk()
        time.sleep(self.ttl + SLACK_S)
        self.log.append("waited a TTL")
        now = self.now
        for path in PATHS:
            got, _, _ = self.timed(lambda path=path: stat_of(self.root / path))
            want = {("size", len(s[1])) if s[0] == "file" else s for s in self.allowed([now], path)}
            self.check(f"stat {path!r} a TTL after the last change", got, want)
        for path in DIRS:
            if observe(now, path) == ("dir",):
                got, _, _ = self.timed(
                    lambda path=path: ("listing", scan(self.root / path)))
                self.check(f"scandir {path!r} a TTL after the last change", got, {("listing", children(now, path))},
                           listed=path)
        for path in FILES:
            if observe(now, path)[0] == "file":
                got, _, _ = self.timed(lambda path=path: read_path(self.root / path))
                self.check(f"read {path!r} a TTL after the last change", got, {observe(now, path)})

    def run(self, steps: int) -> None:
        ops: list[tuple[Callable[[], None], float]] = [
            (self.ch_put_new, 6), (self.ch_overwrite, 6), (self.ch_delete, 4), (self.ch_delete_prefix, 1.5),
            (self.ch_marker, 1.5), (self.ch_file_and_prefix, 2 if self.conflicts else 0),
            (self.op_stat, 8), (self.op_listdir, 6), (self.op_read, 8), (self.op_open_held, 2), (self.op_read_held, 4),
            (self.op_close_held, 1.5), (self.op_chdir, 4), (self.op_walk, 2), (self.op_open_dir_fd, 1.5),
            (self.op_scan_dir_fd, 3), (self.op_race, 1.5), (self.op_wait_ttl, 0.6)]
        fns, weights = zip(*ops, strict=True)
        try:
            for _ in range(steps):
                fn = self.rng.choices(fns, weights)[0]
                self.ran[fn.__name__] = self.ran.get(fn.__name__, 0) + 1
                fn()
            self.op_wait_ttl()
        finally:
            for fd, _, _ in self.held:
                os.close(fd)
            for fd, *_ in self.dir_fds:
                os.close(fd)
            self.held.clear()
            self.dir_fds.clear()
        # (The wait for a TTL also ends every run.)
        self.chosen = {fn.__name__ for fn, w in ops if w and fn != self.op_wait_ttl}


def join(parent: str, name: str) -> str:
    return f"{parent}/{name}" if parent else name


def read_path(path: Path) -> Seen:
    """A file's bytes, read whole through one descriptor; ("dir",) for a directory."""
    fd = os.open(path, os.O_RDONLY)
    try:
        return ("dir",) if stat.S_ISDIR(os.fstat(fd).st_mode) else ("file", read_all(fd))
    finally:
        os.close(fd)


def read_all(fd: int) -> bytes:
    out = bytearray()
    while chunk := os.pread(fd, 1 << 20, len(out)):
        out += chunk
    return bytes(out)


def scan(directory: Path | str | int) -> frozenset[tuple[str, bool]]:
    """A directory's names and types (from readdir's d_type), by path or descriptor."""
    return frozenset((e.name, e.is_dir()) for e in os.scandir(directory))


def stat_of(path: Path) -> Seen:
    st = os.stat(path)
    return ("dir",) if stat.S_ISDIR(st.st_mode) else ("size", st.st_size)


# name: (server, --metadata-ttl, seconds of TTL in the model, the first seed, steps)
CONFIGS = {
    "ttl-1": ("moto", "1", 1.0, 100, 150),
    "ttl-0": ("moto", "0", 0.0, 200, 120),
    "forever": ("moto", "forever", float("inf"), 300, 150),
    # Listings as S3 encodes them (a space as '+'), not moto's '%20'.
    "seaweedfs-ttl-1": ("seaweedfs", "1", 1.0, 400, 120),
}


@pytest.mark.parametrize("config", [pytest.param(c, marks=pytest.mark.seaweedfs) if CONFIGS[c][0] == "seaweedfs"
                                    else c for c in CONFIGS])
def test_the_namespace_follows_another_writer_within_the_ttl(config: str, request: pytest.FixtureRequest,
                                                              mountpoint: Path) -> None:
    server_name, ttl_arg, ttl, seed, steps = CONFIGS[config]
    seed += SHIFT
    s3: S3Server = request.getfixturevalue({"moto": "moto_server", "seaweedfs": "seaweed_server"}[server_name])
    bucket = new_bucket(s3)
    try:
        with mounted(s3, bucket, mountpoint, "--metadata-ttl", ttl_arg, "--read-timeout", "10", allowed=ALLOWED):
            history: list[tuple[float, float, State]] = [(0.0, float("inf"), {})]
            ran: set[str] = set()
            for run in range(RUNS):
                # The next seed goes on from the bucket's history (a mount with `forever` knows it).
                fuzz = Fuzz(s3, bucket, mountpoint, seed + run, history, ttl=ttl, seaweedfs=server_name == "seaweedfs")
                fuzz.run(STEPS or steps)
                print(f"seed {seed + run}: {fuzz.ran}")
                ran |= set(fuzz.ran)
            # (The wait for a TTL also ends every run.) The suite's seeds choose every operation, which keeps the
            # schedule honest; another seed may well not (seed 500 never chose `op_race`, weight 1.5 of ~62, in its
            # 150 steps), and what it did choose was checked all the same.
            if SHIFT == 0:
                assert fuzz.chosen <= ran, f"operations never chosen: {fuzz.chosen - ran}"
            elif fuzz.chosen - ran:
                print(f"operations never chosen: {fuzz.chosen - ran}")
    finally:
        delete_bucket(s3, bucket)
