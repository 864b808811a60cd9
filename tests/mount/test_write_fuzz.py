"""Differential fuzzing of the `--writable` write path through a real mount: seeded random sequences of file-system
operations, each checked against a model of what the README's "Writing checkpoints" promises.

What it explores, on a small pool of names (`a`, `b`, `c`, `d/x`, `d/y`, `e/z`; directories `d`, `e`; `a`, `d/` and
`d/x` stored beforehand by someone else, so that the rules for files this mount did not write apply too):
- opens: a new file (O_WRONLY or O_RDWR, with O_TRUNC, O_EXCL or O_APPEND), an existing object (a whole rewrite with
  O_TRUNC, an empty one without, appended to or not; appends to one with bytes and partial rewrites refused), a file
  being written (EBUSY), a directory;
- on a file being written: sequential writes of 1 byte to 6 MiB (parts of 5 MiB, so that multipart uploads happen),
  pwrite at the end, at a gap and back over written bytes (EINVAL, and the file is lost: EIO at its close), O_APPEND
  writes, ftruncate to the same size, up while still empty (what safetensors does) and otherwise (EOPNOTSUPP), fsync,
  dup'ed descriptors closed in any order, a shared mmap (ENODEV), reading back through the writing descriptor (EBUSY);
- renames and unlinks of files being written and of stored ones, onto free and taken names (a file renamed while its
  upload is under way leaves its old name busy until its close), mkdir, rmdir (and mkdir again), renames of
  directories; `torch.save` and `safetensors.torch.save_file` of small tensors, onto free and taken names;
- reads: a stored file read whole (read or a shared mmap), and a reader held open across the operations, whose every
  read is bytes of one version stored at its path (short where a rewrite made the file shorter) or EIO;
- configurations: streamed and with `--cache-dir` (where a pre-sized file is uploaded from its local copy), with
  `--allow-overwrite --allow-delete` and without them (every refusal with its documented errno and the bucket
  untouched), all with parts of 5 MiB, 2 connections and `--memory-limit 128M`, on moto; a shorter run on SeaweedFS.

After every operation: its result (or errno) is the model's; the mount lists exactly the model's names with the
model's sizes (`stat`); the bucket (read with boto3) holds exactly the model's keys and sizes, and the bytes of every
key changed since the last look; every stored file reads back byte-exact through the mount; once no file is open for
writing, no multipart upload is left. At the end, a fresh mount (with the same cache dir) reads every file back.
A mismatch fails with the operations that led to it, to be shrunk into a test of its own (`test_writes.py`: the
audit of this fuzzer found seven, each with its test there).
"""

from __future__ import annotations

import dataclasses
import errno
import mmap
import os
import random
import stat
from pathlib import Path

import pytest

from tests.helpers import (
    FETCH_FAILED,
    READ_FAILED,
    MiB,
    S3Server,
    delete_bucket,
    mounted,
    new_bucket,
    put_objects,
    random_bytes,
    wait_for,
)

PART = 5 * MiB
MAX_FILE = 12 * MiB  # a file of this mount: at most two parts and a bit
FILES = ("a", "b", "c", "d/x", "d/y", "e/z")
MORE_FILES = ("f", "g", "d/w", "e/y")  # without --allow-overwrite/--allow-delete names fill up: room for new files
DIRS = ("d", "e")
SEEDED = {"a": random_bytes(3000, 90), "d/": b"", "d/x": random_bytes(7000, 91)}  # stored by someone else

# What the daemon says when it refuses what the fuzzer asks for, as documented.
ALLOWED = (r"only sequential writes are supported", r"will not be stored", r"needs --allow-overwrite",
           r"needs --allow-delete", r"only whole rewrites", r"is not supported \(only sequential writes\)",
           r"is not renamed \(EXDEV\)", r"still uploads under this name", r"a truncate of a stored file",
           # The held reader of a file deleted or replaced meanwhile: EIO, never other bytes.
           FETCH_FAILED, READ_FAILED)


@dataclasses.dataclass(eq=False)
class Writer:
    """A file being written through the mount, as the model sees it."""

    fds: list[int]
    path: str
    rdwr: bool
    append: bool
    replaces: str | None = None  # an O_TRUNC rewrite of a stored object, which stays in the bucket until the close
    data: bytearray = dataclasses.field(default_factory=bytearray)
    declared: int = 0  # what an extending ftruncate of the still empty file asked for
    pos: int = 0  # the descriptors' shared file offset
    failed: bool = False  # a write out of order: never stored, EIO at each close
    dropped: bool = False  # a close failed: it left the tree (descriptors may remain)
    unlinked: bool = False
    deferred: bool = False  # with --cache-dir, extended by ftruncate before its first write: uploaded at close
    upload_key: str | None = None  # the name its multipart upload began under (its first full part)

    @property
    def size(self) -> int:
        return max(len(self.data), self.declared)

    @property
    def content(self) -> bytes:
        return bytes(self.data) + bytes(self.declared - len(self.data)) if self.declared > len(self.data) else \
            bytes(self.data)

    @property
    def visible(self) -> bool:
        return not (self.unlinked or self.dropped)


class Fuzz:
    def __init__(self, s3: S3Server, bucket: str, root: Path, seed: int, *, overwrite: bool, delete: bool,
                 cache_dir: bool, files: tuple[str, ...] = FILES):
        self.s3, self.client, self.bucket, self.root = s3, s3.client(), bucket, root
        self.rng = random.Random(seed)
        self.seed = seed
        self.overwrite, self.delete, self.cache_dir = overwrite, delete, cache_dir
        self.files = files
        self.objects: dict[str, bytes] = dict(SEEDED)  # the bucket
        self.mine: set[str] = set()  # keys this mount stored (renames of them included): renamed without --allow-delete
        self.made: set[str] = set()  # directories this mount made (renames of them included): the same
        self.writers: list[Writer] = []
        self.unchecked: set[str] = set(self.objects)  # keys whose bytes were not compared since they changed
        self.log: list[str] = []
        self.counter = 0
        # A reader held open across operations: (fd, path, every version stored at the path since it opened).
        self.reader: tuple[int, str, list[bytes]] | None = None

    # -- the model's view -----------------------------------------------------------------------------

    def pending(self, path: str) -> Writer | None:
        return next((w for w in self.writers if w.visible and w.path == path), None)

    def is_dir(self, path: str) -> bool:
        return path == "" or any(k.startswith(path + "/") for k in self.objects) or any(
            w.visible and w.path.startswith(path + "/") for w in self.writers)

    def kind(self, path: str) -> str | None:
        if self.pending(path) is not None:
            return "pending"
        if path in self.objects and not path.endswith("/"):
            return "file"
        if self.is_dir(path):
            return "dir"
        return None

    def dir_empty(self, path: str) -> bool:
        return not any(k.startswith(path + "/") and k != path + "/" for k in self.objects) and not any(
            w.visible and w.path.startswith(path + "/") for w in self.writers)

    def listing(self, path: str) -> list[str]:
        prefix = path + "/" if path else ""
        names = set()
        for key in [*self.objects, *(w.path for w in self.writers if w.visible)]:
            if key.startswith(prefix) and key != prefix:
                names.add(key[len(prefix):].split("/")[0])
        return sorted(names)

    def busy(self, path: str, w: Writer | None = None) -> bool:
        """Whether another file, renamed away from `path` while it was written, still uploads under it."""
        return any(o.visible and o.upload_key == path and o is not w for o in self.writers)

    def parent_exists(self, path: str) -> bool:
        return self.kind(path.rpartition("/")[0]) == "dir"

    # -- running one operation ------------------------------------------------------------------------

    def p(self, path: str) -> Path:
        return self.root / path

    def expect(self, what: str, want: int | None, fn, *args):  # noqa: ANN001, ANN201
        """Run fn(*args); its errno must be `want` (None: success). Its result."""
        self.log.append(f"{what} -> {errno.errorcode.get(want, 'ok') if want else 'ok'}")
        try:
            result = fn(*args)
        except OSError as exc:
            assert exc.errno == want, self.fail_text(f"{what}: got {errno.errorcode.get(exc.errno, exc.errno)}, "
                                                     f"the model says {errno.errorcode.get(want, 'success')}")
            return None
        assert want is None, self.fail_text(f"{what}: succeeded, the model says {errno.errorcode.get(want)}")
        return result

    def fail_text(self, message: str) -> str:
        state = {k: len(v) for k, v in self.objects.items()}
        writers = [(w.path, w.size, "failed" if w.failed else "", "dropped" if w.dropped else "",
                    "unlinked" if w.unlinked else "", w.replaces) for w in self.writers]
        return (f"{message}\nseed {self.seed}; the model's bucket {state}, its files being written {writers}; "
                "operations so far:\n  " + "\n  ".join(self.log[-60:]))

    def data(self, n: int) -> bytes:
        self.counter += 1
        return random_bytes(n, self.seed * 100_000 + self.counter)

    def size_to_write(self, w: Writer) -> int:
        r = self.rng.random()
        n = self.rng.randint(1, 4096) if r < 0.45 else self.rng.randint(4097, 300_000) if r < 0.75 else \
            self.rng.randint(MiB, 6 * MiB)
        return max(1, min(n, MAX_FILE - w.size))

    def op_open(self) -> None:
        free = [p for p in self.files if self.kind(p) is None and self.parent_exists(p)]
        path = self.rng.choice(free if free and self.rng.random() < 0.6 else self.files)
        rdwr = self.rng.random() < 0.5
        variant = self.rng.choice(["trunc", "trunc", "trunc", "plain", "excl", "append"])
        flags = (os.O_RDWR if rdwr else os.O_WRONLY) | os.O_CREAT | {
            "trunc": os.O_TRUNC, "plain": 0, "excl": os.O_EXCL, "append": os.O_APPEND}[variant]
        what = f"open({path!r}, {variant}, {'rdwr' if rdwr else 'wronly'})"
        kind = self.kind(path)
        replaces = None
        if not self.parent_exists(path):
            want = errno.ENOENT
        elif kind == "dir":
            want = errno.EISDIR
        elif kind == "pending":
            want = errno.EEXIST if variant == "excl" else errno.EBUSY
        elif kind == "file":
            if variant == "excl":
                want = errno.EEXIST
            elif self.busy(path):
                want = errno.EBUSY
            elif not self.overwrite and not self.objects[path] and variant != "append":
                return self.touch(what, path, flags)
            elif not self.overwrite:
                want = errno.EPERM
            elif variant in ("append", "plain") and self.objects[path]:  # an append to an empty one rewrites it
                want = errno.EOPNOTSUPP
            else:
                want, replaces = None, path
        else:
            want = errno.EBUSY if self.busy(path) else None
        fd = self.expect(what, want, os.open, self.p(path), flags, 0o644)
        if fd is not None:
            self.writers.append(Writer([fd], path, rdwr, variant == "append", replaces))

    def touch(self, what: str, path: str, flags: int) -> None:
        """An open for writing of a stored empty file without --allow-overwrite (a lock file's, a marker's): it opens,
        a write through it is EPERM, and its close stores nothing."""
        fd = self.expect(what, None, os.open, self.p(path), flags, 0o644)
        try:
            self.expect(f"write(touched {path!r})", errno.EPERM, os.write, fd, b"x")
        finally:
            self.expect(f"close(touched {path!r})", None, os.close, fd)

    def live(self) -> list[Writer]:
        return [w for w in self.writers if w.fds]

    def op_write(self, w: Writer) -> None:
        fd = self.rng.choice(w.fds)
        how = self.rng.choices(["write", "pwrite_end", "pwrite_gap", "pwrite_back"], [16, 2, 0.5, 0.5])[0]
        if how == "pwrite_back" and not w.data:
            how = "pwrite_gap"
        n = self.size_to_write(w)
        if how == "write":
            offset = w.size if w.append else w.pos
        elif how == "pwrite_end":
            offset = len(w.data)
        elif how == "pwrite_gap":
            offset = len(w.data) + self.rng.randint(1, 3 * PART // 2)
        else:
            offset = self.rng.randrange(len(w.data))
        if w.append:
            offset = w.size  # Linux: pwrite on an O_APPEND descriptor appends, whatever its offset
        what = f"{how}({w.path!r} fd {fd}, {n} bytes at {offset}; {len(w.data)} written)"
        if w.unlinked:
            want = None
        elif w.failed or w.dropped:
            want = errno.EIO
        elif offset != len(w.data):
            want = errno.EINVAL
        else:
            want = None
        data = self.data(n)
        if how == "write":
            done = self.expect(what, want, os.write, fd, data)
        else:
            done = self.expect(what, want, os.pwrite, fd, data, offset)
        if want == errno.EINVAL:
            w.failed = True
        if done is not None:
            assert done == n, self.fail_text(f"{what}: wrote {done} bytes")
            if not w.unlinked:
                w.data += data
                if len(w.data) >= PART and w.upload_key is None and not w.deferred:
                    w.upload_key = w.path
            if how == "write":
                w.pos = offset + n

    def op_seek_end(self, w: Writer) -> None:
        """lseek(SEEK_END): where a plain write() continues after a pwrite (the kernel's size of the file)."""
        if not w.unlinked:
            w.pos = self.expect(f"lseek({w.path!r}, SEEK_END)", None, os.lseek, self.rng.choice(w.fds), 0, os.SEEK_END)
            # (A file that failed has the size it had, or, a rewrite, its old object's: either will do.)
            assert w.pos == w.size or w.dropped, self.fail_text(
                f"lseek(SEEK_END) of {w.path}: {w.pos}, the model says {w.size}")

    def op_truncate(self, w: Writer) -> None:
        if w.unlinked:
            return
        fd = self.rng.choice(w.fds)
        size = self.rng.choice([w.size, w.size + self.rng.randint(1, 2 * PART), self.rng.randint(0, w.size), 0])
        what = f"ftruncate({w.path!r}, {size}; size {w.size}, {len(w.data)} written)"
        if size == w.size:
            want = None
        elif not w.data and not w.failed and not w.dropped:
            want = None
        else:
            want = errno.EOPNOTSUPP
        self.expect(what, want, os.ftruncate, fd, size)
        if want is None and not w.data:
            w.declared = size
            w.deferred = self.cache_dir and size > 0

    def op_fsync(self, w: Writer) -> None:
        want = errno.EIO if (w.failed or w.dropped) and not w.unlinked else None
        self.expect(f"fsync({w.path!r})", want, os.fsync, self.rng.choice(w.fds))

    def op_dup(self, w: Writer) -> None:
        if len(w.fds) < 3:
            w.fds.append(self.expect(f"dup({w.path!r})", None, os.dup, self.rng.choice(w.fds)))

    def op_mmap(self, w: Writer) -> None:
        if not w.rdwr or w.unlinked or w.size == 0:
            return
        fd = self.rng.choice(w.fds)

        def shared_map() -> None:
            mmap.mmap(fd, min(w.size, 4096), mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE).close()

        self.expect(f"mmap(shared, {w.path!r})", errno.ENODEV, shared_map)
        if w.failed:
            w.dropped = True  # CPython's mmap maps a dup of the descriptor, closed at the failure: a close (EIO)

    def op_read_own(self, w: Writer) -> None:
        if w.rdwr and not w.unlinked:
            self.expect(f"pread(own fd of {w.path!r})", errno.EBUSY, os.pread, self.rng.choice(w.fds), 10, 0)

    def op_close(self, w: Writer) -> None:
        fd = w.fds.pop(self.rng.randrange(len(w.fds)))
        last = not w.fds
        what = f"close({w.path!r}{', last' if last else ''}; {w.size} bytes)"
        if w.unlinked:
            want = None
        elif w.failed or w.dropped:
            want = errno.EIO
        else:
            want = None
        self.expect(what, want, os.close, fd)
        if want == errno.EIO:
            w.dropped = True
        if not last or w.unlinked or w.dropped:
            return
        self.stored(w.path, w.content)
        if w.size == 0:
            # An empty file is stored at RELEASE, just after close(2) returned.
            wait_for(f"the empty {w.path} stored", lambda: self.bucket_bytes(w.path), lambda b: b == b"", timeout=5)
        self.writers.remove(w)

    def stored(self, path: str, content: bytes) -> None:
        self.objects[path] = content
        if self.reader is not None and self.reader[1] == path:
            self.reader[2].append(content)
        self.mine.add(path)
        self.unchecked.add(path)

    def op_rename(self) -> None:
        if self.rng.random() < 0.15:
            return self.op_rename_dir()
        src, dst = self.rng.choice(self.files), self.rng.choice(self.files)
        if self.rng.random() < 0.5 and self.live():  # most renames are of files being written
            src = self.rng.choice(self.live()).path
        what = f"rename({src!r}, {dst!r})"
        sk, dk = self.kind(src), self.kind(dst)
        if sk is None or not self.parent_exists(dst):
            return self.expect(what, errno.ENOENT, os.rename, self.p(src), self.p(dst))
        if src == dst:
            return self.expect(what, None, os.rename, self.p(src), self.p(dst))
        if dk == "pending":
            want = errno.EBUSY
        elif dk == "file" and not self.overwrite:
            want = errno.EPERM
        else:
            want = None
        w = self.pending(src)
        if want is None and self.busy(dst, w):
            want = errno.EBUSY
        if want is None and w is not None and w.replaces is not None and not (w.replaces in self.mine or self.delete):
            want = errno.EPERM
        if want is None and w is None and not (src in self.mine or self.delete):
            want = errno.EPERM
        self.expect(what, want, os.rename, self.p(src), self.p(dst))
        if want is not None:
            return None
        if self.reader is not None and self.reader[1] == src:
            # The held descriptor goes with its file (the kernel's inode), as on a local disk: an O_TRUNC rewrite of
            # the new name is that inode, whose new bytes the reader may read (WRITE_FUZZ_SEED=14: `a` held, renamed
            # onto `d/y`, then torch.save of `d/y`; the model kept the reader at `a` and called those bytes no
            # version's). A file stored at `src` later is another inode: allowing its bytes too only widens.
            self.reader = (self.reader[0], dst, self.reader[2])
        if w is not None:
            if w.replaces is not None:
                self.objects.pop(w.replaces)  # the object it replaces goes at the rename, as on a local disk
                self.mine.discard(w.replaces)
            # Onto a stored file: that object stays in the bucket until this one is stored under its name, as the
            # object an O_TRUNC rewrite replaces does.
            w.replaces = dst if dk == "file" else None
            w.path = dst
        else:
            self.objects[dst] = self.objects.pop(src)
            self.unchecked.add(dst)
            if src in self.mine:
                self.mine.add(dst)
            else:
                self.mine.discard(dst)
            self.mine.discard(src)
        return None

    def op_rename_dir(self) -> None:
        src, dst = self.rng.choice(DIRS), self.rng.choice(DIRS)
        what = f"rename({src!r}, {dst!r})"
        if self.kind(src) is None:
            return self.expect(what, errno.ENOENT, os.rename, self.p(src), self.p(dst))
        if src == dst:
            return self.expect(what, None, os.rename, self.p(src), self.p(dst))
        if self.kind(dst) is not None:
            return None  # onto another directory: not explored
        if not self.dir_empty(src):
            want = errno.EXDEV
        else:  # its marker is deleted: one this mount did not make needs --allow-delete
            want = None if self.delete or src in self.made else errno.EPERM
        self.expect(what, want, os.rename, self.p(src), self.p(dst))
        if want is None:
            self.objects.pop(src + "/", None)
            self.objects[dst + "/"] = b""
            if src in self.made:
                self.made.discard(src)
                self.made.add(dst)
        return None

    def op_unlink(self) -> None:
        path = self.rng.choice(self.files)
        if self.rng.random() < 0.4 and self.live():
            path = self.rng.choice(self.live()).path
        what = f"unlink({path!r})"
        kind, w = self.kind(path), self.pending(path)
        if kind is None:
            want = errno.ENOENT
        elif kind == "dir":
            want = errno.EISDIR
        elif w is not None and w.replaces is None:
            want = None
        else:
            want = None if self.delete else errno.EPERM
        self.expect(what, want, os.unlink, self.p(path))
        if want is not None:
            return
        if w is not None:
            if w.replaces is not None:
                self.objects.pop(w.replaces)
                self.mine.discard(w.replaces)
            w.unlinked = True
            if not w.fds:
                self.writers.remove(w)
        else:
            self.objects.pop(path)
            self.mine.discard(path)

    def op_mkdir(self) -> None:
        path = self.rng.choice(DIRS)
        want = errno.EEXIST if self.kind(path) is not None else None
        self.expect(f"mkdir({path!r})", want, os.mkdir, self.p(path))
        if want is None:
            self.objects[path + "/"] = b""
            self.made.add(path)

    def op_rmdir(self) -> None:
        path = self.rng.choice(DIRS)
        kind = self.kind(path)
        if kind is None:
            want = errno.ENOENT
        elif kind != "dir":
            want = errno.ENOTDIR
        elif not self.delete:
            want = errno.EPERM
        elif not self.dir_empty(path):
            want = errno.ENOTEMPTY
        else:
            want = None
        self.expect(f"rmdir({path!r})", want, os.rmdir, self.p(path))
        if want is None:
            self.objects.pop(path + "/", None)
            self.made.discard(path)

    def op_read(self) -> None:
        path = self.rng.choice(self.files)
        kind = self.kind(path)
        if kind == "pending":
            self.expect(f"open({path!r}, rdonly)", errno.EBUSY, os.open, self.p(path), os.O_RDONLY)
        elif kind == "file":
            fd = self.expect(f"open({path!r}, rdonly)", None, os.open, self.p(path), os.O_RDONLY)
            try:
                want = self.objects[path]
                if want and self.rng.random() < 0.5:
                    with mmap.mmap(fd, len(want), mmap.MAP_SHARED, mmap.PROT_READ) as m:
                        got = bytes(m)
                else:
                    got = os.pread(fd, len(want) + 1, 0)
                assert got == want, self.fail_text(f"{path}: read {len(got)} bytes, not the {len(want)} stored")
            finally:
                os.close(fd)

    def op_hold(self) -> None:
        """Open a stored file for reading and keep it open (or close the one held): its reads, checked after every
        operation, are each bytes of one version stored at its path (maybe short), or EIO; never two mixed."""
        if self.reader is not None:
            self.log.append(f"close(reader of {self.reader[1]!r}) -> ok")
            os.close(self.reader[0])
            self.reader = None
            return
        path = self.rng.choice(self.files)
        if self.kind(path) == "file":
            fd = self.expect(f"open({path!r}, rdonly, held)", None, os.open, self.p(path), os.O_RDONLY)
            self.reader = (fd, path, [self.objects[path]])

    def check_reader(self) -> None:
        if self.reader is None:
            return
        fd, path, versions = self.reader
        longest = max(len(v) for v in versions)
        offset = self.rng.randint(0, longest)
        n = self.rng.randint(1, MiB)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)  # a read the daemon answers, not the page cache
        try:
            got = os.pread(fd, n, offset)
        except OSError as exc:
            assert exc.errno == errno.EIO, self.fail_text(f"held reader of {path}: {exc!r}")
            return
        # Short where the file is shorter now for the kernel: an O_TRUNC rewrite through this mount is the same inode,
        # whose size is what the rewrite has written so far (README); never bytes of no version.
        assert any(got == v[offset:offset + len(got)] for v in versions), self.fail_text(
            f"held reader of {path}: {len(got)} bytes at {offset} are no version's ({len(versions)} stored)")

    def op_library_save(self, ref_dir: Path) -> None:
        """torch.save or safetensors' save_file of small tensors, compared with the same call on a local disk."""
        import torch
        from safetensors.torch import save_file

        path = self.rng.choice(self.files)
        kind = self.kind(path)
        if kind in ("pending", "dir"):
            return
        library = self.rng.choice(["torch.save", "save_file"])
        n = self.rng.choice([10, 3000, 700_000])  # float32: up to 2.7 MB
        torch.manual_seed(self.seed * 1000 + self.counter)
        self.counter += 1
        tensors = {"w": torch.randn(n), "b": torch.arange(7)}
        ref = ref_dir / f"{self.counter}" / path.rpartition("/")[2]  # torch.save records the file's name
        ref.parent.mkdir(parents=True)
        save = torch.save if library == "torch.save" else save_file
        save(tensors, str(ref))
        ok = self.parent_exists(path) and (kind is None or self.overwrite) and not self.busy(path)
        what = f"{library}({path!r}, {ref.stat().st_size} bytes)"
        self.log.append(f"{what} -> {'ok' if ok else 'fails'}")
        try:
            save(tensors, str(self.p(path)))
        except Exception as exc:  # noqa: BLE001 - whatever each library raises
            assert not ok, self.fail_text(f"{what}: {exc!r}")
            return
        assert ok, self.fail_text(f"{what}: succeeded, the model says it fails")
        self.stored(path, ref.read_bytes())

    # -- the checks --------------------------------------------------------------------------------------

    def bucket_bytes(self, key: str) -> bytes | None:
        try:
            return self.client.get_object(Bucket=self.bucket, Key=key)["Body"].read()
        except self.client.exceptions.NoSuchKey:
            return None

    def check(self) -> None:
        for d in ("", *DIRS):
            if self.kind(d) == "dir":
                got = sorted(os.listdir(self.p(d)))
                assert got == self.listing(d), self.fail_text(f"ls {d or '/'}: {got}, the model says {self.listing(d)}")
        for path in self.files:
            kind = self.kind(path)
            try:
                st = os.stat(self.p(path))
            except FileNotFoundError:
                st = None
            except NotADirectoryError:
                st = None
            if kind is None:
                assert st is None, self.fail_text(f"stat {path}: exists ({st.st_size} bytes), the model says no")
                continue
            assert st is not None, self.fail_text(f"stat {path}: ENOENT, the model says {kind}")
            if kind == "dir":
                assert stat.S_ISDIR(st.st_mode), self.fail_text(f"stat {path}: not a directory")
                continue
            w = self.pending(path)
            size = w.size if w is not None else len(self.objects[path])
            assert stat.S_ISREG(st.st_mode) and st.st_size == size, self.fail_text(
                f"stat {path}: {st.st_size} bytes, the model says {size} ({kind})")
        got = {}
        for page in self.client.get_paginator("list_objects_v2").paginate(Bucket=self.bucket):
            got.update({o["Key"]: o["Size"] for o in page.get("Contents", ())})
        want = {k: len(v) for k, v in self.objects.items()}
        assert got == want, self.fail_text(f"bucket: {got}, the model says {want}")
        for key in sorted(self.unchecked):
            if key in self.objects:
                assert self.bucket_bytes(key) == self.objects[key], self.fail_text(f"bucket: wrong bytes in {key}")
                if self.kind(key) == "file":
                    assert self.p(key).read_bytes() == self.objects[key], self.fail_text(f"{key}: wrong bytes read")
        self.unchecked.clear()
        if not self.live():
            uploads = self.client.list_multipart_uploads(Bucket=self.bucket).get("Uploads", ())
            assert not uploads, self.fail_text(f"uploads left: {[u['Key'] for u in uploads]}")

    # -- the loop ----------------------------------------------------------------------------------------

    def run(self, steps: int, ref_dir: Path, libraries: bool) -> None:
        try:
            for _ in range(steps):
                self.step(ref_dir, libraries)
                self.check()
                self.check_reader()
            while self.live():
                self.op_close(self.live()[0])
            self.check()
        finally:
            if self.reader is not None:
                os.close(self.reader[0])
            for w in self.writers:
                for fd in w.fds:
                    try:
                        os.close(fd)
                    except OSError:
                        pass

    def step(self, ref_dir: Path, libraries: bool) -> None:
        live = self.live()
        w = self.rng.choice(live) if live else None
        ops: list[tuple[str, float]] = [("rename", 2), ("unlink", 1.5), ("mkdir", 1), ("rmdir", 1), ("read", 1.5),
                                        ("hold", 0.7)]
        if len(live) < 2:
            ops.append(("open", 6 if not live else 2))
        if w is not None:
            spoilt = w.failed or w.dropped or w.unlinked  # a few more operations on it, then its close
            ops += [("write", 4 if spoilt else 20), ("truncate", 2), ("fsync", 1), ("dup", 1), ("mmap", 0.5),
                    ("read_own", 0.5), ("seek_end", 1.5), ("close", 8 if spoilt else 3)]
        if libraries:
            ops.append(("library", 1))
        op = self.rng.choices([o for o, _ in ops], [weight for _, weight in ops])[0]
        if op == "library":
            self.op_library_save(ref_dir)
        elif op in ("open", "rename", "unlink", "mkdir", "rmdir", "read", "hold"):  # of the tree, not of `w`
            getattr(self, f"op_{op}")()
        else:
            assert w is not None
            getattr(self, f"op_{op}")(w)


CONFIGS = {
    # name: (server, seed, steps, --allow-overwrite/--allow-delete, --cache-dir, torch and safetensors)
    "moto-streamed-overwrite-delete": ("moto_server", 1, 500, True, False, True),
    "moto-cache-dir-overwrite-delete": ("moto_server", 2, 500, True, True, True),
    "moto-cache-dir-no-flags": ("moto_server", 3, 300, False, True, False),
    "seaweedfs-streamed-overwrite-delete": ("seaweed_server", 4, 150, True, False, False),
}


@pytest.mark.parametrize("config", [pytest.param(name, marks=pytest.mark.seaweedfs) if "seaweed" in name else name
                                    for name in CONFIGS])
def test_random_write_sequences_match_the_model(config: str, request: pytest.FixtureRequest, mountpoint: Path,
                                                tmp_path: Path) -> None:
    server, seed, steps, flags, cache_dir, libraries = CONFIGS[config]
    if libraries:
        pytest.importorskip("torch")
    seed = int(os.environ.get("WRITE_FUZZ_SEED", seed))  # to explore beyond the suite's seeds
    s3: S3Server = request.getfixturevalue(server)
    bucket = new_bucket(s3)
    put_objects(s3, bucket, SEEDED)
    args = ["--writable", "--metadata-ttl", "60", "--write-part-size", "5M", "--max-connections", "2",
            "--memory-limit", "128M"]
    if flags:
        args += ["--allow-overwrite", "--allow-delete"]
    if cache_dir:
        args += ["--cache-dir", str(tmp_path / "cache")]
    fuzz = Fuzz(s3, bucket, mountpoint, seed, overwrite=flags, delete=flags, cache_dir=cache_dir,
                files=FILES if flags else FILES + MORE_FILES)
    with mounted(s3, bucket, mountpoint, *args, allowed=ALLOWED):
        fuzz.run(steps, tmp_path / "ref", libraries)
    # What a fresh mount (with the NVMe cache the writes filled) reads.
    other = tmp_path / "fresh"
    with mounted(s3, bucket, other, *(["--cache-dir", str(tmp_path / "cache")] if cache_dir else [])):
        for key, data in fuzz.objects.items():
            if not key.endswith("/"):
                assert (other / key).read_bytes() == data, f"{key}: wrong bytes on a fresh mount"
    delete_bucket(s3, bucket)
