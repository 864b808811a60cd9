"""One benchmark workload per process: `python bench/scenarios.py NAME ARGS...` prints one JSON line.

Timing starts after imports (and S3 client setup) and ends when every byte has been read; it must never
print anything else on stdout, nor cache or reuse data between runs (each run is a fresh process).

Workloads (each reads whole files, so `bytes` is their total size):
  load_file FILE...          safetensors.numpy.load_file of each file, in order (offset order inside)
  load_file_threads FILE...  the same, one thread per file, all at once (a 4-GPU node loading shards)
  safe_open FILE...          safe_open(f, "np") then get_tensor(k) for k in f.keys() (lexicographic)
  safe_open_reverse FILE...  the same in reverse key order
  natural_threads FILE...    get_tensor in natural key order (layers.2 before layers.10), 4 threads
                             (transformers v5's loader)
  quarters FILE...           4 processes, each loading every 4th tensor of every file, all at once
                             (tensor-parallel ranks mmapping the same shard); wall time of all four
  download_load KEY...       boto3 download_file of each key to --tmp, then load_file of each
S3 workloads read BENCH_BUCKET, BENCH_ENDPOINT_URL and the AWS_* credentials from the environment.
With --digest, a sha256 over every tensor (name, dtype, shape, sha256 of its bytes; sorted by name) is
added *after* the timing.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import hashlib
import json
import os
import re
import subprocess
import sys
import threading
import time
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import numpy as np

#: boto3's connections for download_file (its transfer manager uses 10 threads).
DOWNLOAD_THREADS = 16
#: Touch one byte per page of every tensor, as a copy to the GPU would, so lazy (mmap-backed)
#: results cannot pass for loaded ones.
PAGE_BYTES = 4096


def touch(array: np.ndarray) -> int:
    return int(array.reshape(-1).view(np.uint8)[::PAGE_BYTES].sum())


def tensor_line(name: str, array: np.ndarray) -> str:
    data = hashlib.sha256(np.ascontiguousarray(array).view(np.uint8).reshape(-1).data).hexdigest()
    return f"{name}|{array.dtype.str}|{array.shape}|{data}"


def lines_digest(lines: Iterable[str]) -> str:
    h = hashlib.sha256()
    for line in sorted(lines):
        h.update(line.encode() + b"\n")
    return h.hexdigest()


def tensors_digest(tensors: Iterable[tuple[str, np.ndarray]]) -> str:
    """Independent of the order (and the process) the tensors were read in: one line per tensor, sorted."""
    return lines_digest(tensor_line(name, array) for name, array in tensors)


def files_digest(paths: Iterable[str | os.PathLike[str]]) -> str:
    from safetensors.numpy import load_file

    everything: list[tuple[str, np.ndarray]] = []
    for path in paths:
        everything.extend(load_file(path).items())
    return tensors_digest(everything)


def run_load_file(paths: list[str], keep: list[tuple[str, np.ndarray]] | None) -> None:
    from safetensors.numpy import load_file

    for path in paths:
        tensors = load_file(path)
        for name, array in tensors.items():
            touch(array)
            if keep is not None:
                keep.append((name, array))


def run_load_file_threads(paths: list[str], keep: list[tuple[str, np.ndarray]] | None) -> None:
    with concurrent.futures.ThreadPoolExecutor(max_workers=len(paths)) as pool:
        parts: list[list[tuple[str, np.ndarray]]] = [[] for _ in paths]
        futures = [
            pool.submit(run_load_file, [p], part if keep is not None else None)
            for p, part in zip(paths, parts, strict=True)
        ]
        for future in futures:
            future.result()
    if keep is not None:
        for part in parts:
            keep.extend(part)


def run_safe_open(paths: list[str], keep: list[tuple[str, np.ndarray]] | None) -> None:
    from safetensors import safe_open

    for path in paths:
        with safe_open(path, framework="np") as f:
            names = f.keys()  # lexicographic: the order vLLM reads in, which is what is measured
            for name in names:
                array = f.get_tensor(name)
                touch(array)
                if keep is not None:
                    keep.append((name, array))


def run_safe_open_reverse(paths: list[str], keep: list[tuple[str, np.ndarray]] | None) -> None:
    from safetensors import safe_open

    for path in paths:
        with safe_open(path, framework="np") as f:
            for name in reversed(list(f.keys())):
                array = f.get_tensor(name)
                touch(array)
                if keep is not None:
                    keep.append((name, array))


def natural_key(name: str) -> list[object]:
    return [int(part) if part.isdigit() else part for part in re.split(r"(\d+)", name)]


def run_natural_threads(paths: list[str], keep: list[tuple[str, np.ndarray]] | None, threads: int = 4) -> None:
    from safetensors import safe_open

    local = threading.local()  # one handle per thread and file: no sharing of a handle across threads
    lock = threading.Lock()

    def load(item: tuple[str, str]) -> None:
        path, name = item
        handles = local.__dict__.setdefault("handles", {})
        if path not in handles:
            handles[path] = safe_open(path, framework="np")
        array = handles[path].get_tensor(name)
        touch(array)
        if keep is not None:
            with lock:
                keep.append((name, array))

    work = []
    for path in paths:
        with safe_open(path, framework="np") as f:
            work += [(path, name) for name in sorted(f.keys(), key=natural_key)]
    with concurrent.futures.ThreadPoolExecutor(max_workers=threads) as pool:
        list(pool.map(load, work))


def run_quarter(paths: list[str], rank: int, ranks: int, digest: bool) -> None:
    """One rank of `quarters`: tensors rank, rank + ranks, ... of each file in key order; with digest,
    prints one `tensor_line` per tensor."""
    from safetensors import safe_open

    for path in paths:
        with safe_open(path, framework="np") as f:
            for name in list(f.keys())[rank::ranks]:
                array = f.get_tensor(name)
                touch(array)
                if digest:
                    sys.stdout.write(tensor_line(name, array) + "\n")


def run_quarters(paths: list[str], digest: bool, ranks: int = 4) -> str | None:
    """Starts the ranks (interpreter and imports are inside the timing, as for any process a loader
    forks); the tensor lines of all ranks when digest."""
    argv = [sys.executable, __file__, "--rank"]
    procs = [
        subprocess.Popen([*argv, f"{rank}/{ranks}", *(["--digest"] if digest else []), "quarters", *paths],
                         stdout=subprocess.PIPE, text=True)
        for rank in range(ranks)
    ]
    outputs = [proc.communicate()[0] for proc in procs]
    failed = [proc.returncode for proc in procs if proc.returncode != 0]
    if failed:
        raise RuntimeError(f"quarters: ranks exited {failed}")
    return lines_digest(line for out in outputs for line in out.splitlines()) if digest else None


def s3_client(max_connections: int = DOWNLOAD_THREADS) -> Any:
    import boto3
    from botocore.config import Config

    return boto3.client(
        "s3",
        endpoint_url=os.environ["BENCH_ENDPOINT_URL"],
        config=Config(max_pool_connections=max_connections, s3={"addressing_style": "path"}),
    )


def run_download_load(client: Any, keys: list[str], tmp: Path, keep: list[tuple[str, np.ndarray]] | None) -> int:
    bucket = os.environ["BENCH_BUCKET"]
    tmp.mkdir(parents=True, exist_ok=True)
    local = []
    for key in keys:
        path = tmp / key.replace("/", "__")
        client.download_file(bucket, key, str(path))
        local.append(str(path))
    run_load_file(local, keep)
    return sum(os.path.getsize(p) for p in local)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    parser.add_argument(
        "workload",
        choices=("load_file", "load_file_threads", "safe_open", "safe_open_reverse", "natural_threads",
                 "quarters", "download_load"),
    )
    parser.add_argument("targets", nargs="+", help="files (mount workloads) or object keys (S3 workloads)")
    parser.add_argument("--digest", action="store_true", help="also print a sha256 of all tensors")
    parser.add_argument("--tmp", type=Path, help="download directory for download_load")
    parser.add_argument("--rank", help=argparse.SUPPRESS)  # K/N: one rank of `quarters`
    args = parser.parse_args(argv)
    if args.rank:
        rank, ranks = map(int, args.rank.split("/"))
        run_quarter(args.targets, rank, ranks, args.digest)
        return 0
    keep: list[tuple[str, np.ndarray]] | None = [] if args.digest else None
    if args.workload == "download_load" and args.tmp is None:
        parser.error("download_load needs --tmp")
    # Client setup is not timed, as mounting is not timed for the file systems.
    client = s3_client() if args.workload == "download_load" else None

    start = time.perf_counter()
    digest = None
    if args.workload == "download_load":
        nbytes = run_download_load(client, args.targets, args.tmp, keep)
    elif args.workload == "quarters":
        digest = run_quarters(args.targets, args.digest)  # the ranks hash their own tensors, in the timing
        nbytes = sum(os.path.getsize(p) for p in args.targets)
    else:
        runner = {
            "load_file": run_load_file,
            "load_file_threads": run_load_file_threads,
            "safe_open_reverse": run_safe_open_reverse,
            "natural_threads": run_natural_threads,
        }.get(args.workload, run_safe_open)
        runner(args.targets, keep)
        nbytes = sum(os.path.getsize(p) for p in args.targets)
    seconds = time.perf_counter() - start

    result: dict[str, object] = {"seconds": seconds, "bytes": nbytes}
    if digest is not None:
        result["digest"] = digest
    elif keep is not None and args.workload != "quarters":
        result["digest"] = tensors_digest(keep)
    sys.stdout.write(json.dumps(result) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
