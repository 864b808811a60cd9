"""Unmodified ML libraries on a real mount of SeaweedFS, as a user runs them: transformers' `save_pretrained`
(sharded, with its `model.safetensors.index.json`) and `from_pretrained`, safetensors' `safe_open` +
`get_slice` from several processes at once (tensor-parallel ranks, as vLLM loads), a warm load from `--cache-dir`,
`torch.save` and `torch.load(mmap=True)`; under directory names a user gives runs (spaces, unicode, `+`, `=`).
Every tensor is compared with the model the writer had in memory (its `state_dict`, saved beside the test with
`torch.save`). Then the errors a new user meets on the way. (Single-file save_pretrained, torch.save and a
trainer's rotation on a --writable mount are in test_writes.py.)

Each library runs in a process of its own, as a trainer or a server would; the model is a tiny random Llama
built from a config (nothing is downloaded)."""

from __future__ import annotations

import hashlib
import http.server
import json
import os
import subprocess
import sys
import textwrap
import threading
from pathlib import Path

import pytest

from tests.helpers import (
    S3Server,
    daemon_env,
    delete_bucket,
    mount_stats,
    mounted,
    new_bucket,
    not_an_s3_server,
    run_modelfs,
    sha,
    upload,
)

pytestmark = pytest.mark.seaweedfs

# A directory name a user gives a run: a space, unicode, `+` and `=`.
RUN_DIR = "runs/lr=3e-4+warmup/my model ü"

MAKE_MODEL = """
    import sys, torch
    from transformers import LlamaConfig, LlamaForCausalLM
    torch.manual_seed(int(sys.argv[3]))
    config = LlamaConfig(vocab_size=512, hidden_size=128, intermediate_size=384, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                         tie_word_embeddings=False)
    model = LlamaForCausalLM(config)
    model.save_pretrained(sys.argv[1], max_shard_size="300KB")
    torch.save(model.state_dict(), sys.argv[2])
"""

FROM_PRETRAINED = """
    import json, sys, torch
    from transformers import AutoModelForCausalLM
    want = torch.load(sys.argv[2])
    variants = ({}, {"dtype": torch.bfloat16}, {"low_cpu_mem_usage": True})
    for kwargs in variants[:int(sys.argv[3]) if len(sys.argv) > 3 else None]:
        got = AutoModelForCausalLM.from_pretrained(sys.argv[1], **kwargs).state_dict()
        assert set(got) == set(want), set(got) ^ set(want)
        for name, tensor in want.items():
            assert torch.equal(got[name], tensor.to(got[name].dtype)), (kwargs, name)
    print(json.dumps(len(want)))
"""

# One tensor-parallel rank: its row slice of every tensor (its column slice too, for a matrix), by get_slice.
TP_RANK = """
    import json, os, sys, torch
    from safetensors import safe_open
    where, rank, world = sys.argv[1], int(sys.argv[3]), int(sys.argv[4])
    want = torch.load(sys.argv[2])
    with open(os.path.join(where, "model.safetensors.index.json")) as f:
        shards = sorted(set(json.load(f)["weight_map"].values()))
    seen = 0
    for shard in shards:
        with safe_open(os.path.join(where, shard), framework="pt") as f:
            for name in f.keys():
                part, full = f.get_slice(name), want[name]
                rows = full.shape[0] // world
                assert torch.equal(part[rank * rows:(rank + 1) * rows], full[rank * rows:(rank + 1) * rows]), name
                if full.dim() == 2:
                    cols = full.shape[1] // world
                    assert torch.equal(part[:, rank * cols:(rank + 1) * cols], full[:, rank * cols:(rank + 1) * cols])
                seen += 1
    print(json.dumps(seen))
"""


def run_python(code: str, *args: str, timeout: float = 120) -> str:
    """A library user in a process of its own, its stdout; fails the test on error. No hub: a path that is not
    there must fail, not be looked up on huggingface.co."""
    res = subprocess.run([sys.executable, "-c", textwrap.dedent(code), *args], capture_output=True, text=True,
                         timeout=timeout, env={**os.environ, "HF_HUB_OFFLINE": "1"})
    assert res.returncode == 0, res.stderr[-3000:]
    return res.stdout


def make_model(where: Path, seed: int = 0) -> Path:
    """A sharded tiny Llama saved with save_pretrained at `where`; the path of its state dict (torch.save)."""
    ref = where.parent / f"{where.name}.state.pt"
    run_python(MAKE_MODEL, str(where), str(ref), str(seed))
    assert (where / "model.safetensors.index.json").is_file() and len(list(where.glob("*.safetensors"))) > 3
    return ref


def test_from_pretrained_of_a_sharded_model_uploaded_with_boto3(seaweed_server: S3Server, mountpoint: Path,
                                                                 tmp_path: Path) -> None:
    local = tmp_path / "model"
    ref = make_model(local)
    bucket = new_bucket(seaweed_server)
    upload(seaweed_server, bucket, {f"{RUN_DIR}/{f.name}": f for f in local.iterdir()})
    with mounted(seaweed_server, bucket, mountpoint):
        out = run_python(FROM_PRETRAINED, str(mountpoint / RUN_DIR), str(ref))
    assert json.loads(out) > 10
    delete_bucket(seaweed_server, bucket)


def test_tensor_parallel_ranks_load_at_once_and_a_fresh_daemon_loads_from_the_cache(
        seaweed_server: S3Server, mountpoint: Path, tmp_path: Path) -> None:
    local = tmp_path / "model"
    ref = make_model(local)
    bucket = new_bucket(seaweed_server)
    upload(seaweed_server, bucket, {f"{RUN_DIR}/{f.name}": f for f in local.iterdir()})
    cache = ("--cache-dir", str(tmp_path / "cache"))
    world = 4
    with mounted(seaweed_server, bucket, mountpoint, *cache):
        where = str(mountpoint / RUN_DIR)
        ranks = [subprocess.Popen([sys.executable, "-c", textwrap.dedent(TP_RANK), where, str(ref), str(rank),
                                   str(world)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
                 for rank in range(world)]
        for rank in ranks:
            out, err = rank.communicate(timeout=120)
            assert rank.returncode == 0, err[-3000:]
            assert json.loads(out) > 10
        (mountpoint / RUN_DIR / "config.json").read_bytes()  # from_pretrained's other files, into the cache
        (mountpoint / RUN_DIR / "generation_config.json").read_bytes()
    with mounted(seaweed_server, bucket, mountpoint, *cache):
        run_python(FROM_PRETRAINED, str(mountpoint / RUN_DIR), str(ref))
        assert mount_stats(mountpoint)["origin"]["bytes"] == 0
    delete_bucket(seaweed_server, bucket)


TORCH_SAVE_MMAP = """
    import sys, torch
    torch.manual_seed(3)
    state = {"w": torch.randn(1024, 1024), "h": torch.randn(300, 300).half(), "step": torch.tensor(12)}
    torch.save(state, sys.argv[1])
    for mmap in (True, False):
        got = torch.load(sys.argv[1], mmap=mmap, weights_only=True)
        assert got.keys() == state.keys() and all(torch.equal(got[k], state[k]) for k in state), mmap
"""


@pytest.mark.parametrize("cache_dir", [False, True], ids=["streamed", "cache-dir"])
def test_save_pretrained_sharded_onto_a_writable_mount_loads_back_through_it_and_boto3(
        seaweed_server: S3Server, mountpoint: Path, tmp_path: Path, cache_dir: bool) -> None:
    """A trainer's checkpoint straight into the bucket: save_pretrained (safetensors' temp name, ftruncate and
    rename before close, for every shard), then from_pretrained on the same mount at once, torch.save /
    torch.load(mmap=True) beside it, and every object as boto3 downloads it, the bytes the mount served."""
    bucket = new_bucket(seaweed_server)
    cache = ("--cache-dir", str(tmp_path / "cache")) if cache_dir else ()
    where = mountpoint / RUN_DIR / "checkpoint-100"
    ref = tmp_path / "state.pt"
    with mounted(seaweed_server, bucket, mountpoint, "--writable", *cache):
        run_python(MAKE_MODEL, str(where), str(ref), "1")
        run_python(FROM_PRETRAINED, str(where), str(ref), "1")
        run_python(TORCH_SAVE_MMAP, str(where / "optimizer+rank=0.pt"))
        written = {name: sha((where / name).read_bytes()) for name in os.listdir(where)}
    client = seaweed_server.client()
    prefix = f"{RUN_DIR}/checkpoint-100/"
    listed = client.list_objects_v2(Bucket=bucket, Prefix=prefix)["Contents"]
    assert sorted(o["Key"] for o in listed) == sorted([prefix, *(prefix + name for name in written)])  # mkdir's marker
    assert client.list_multipart_uploads(Bucket=bucket).get("Uploads", []) == []
    for name, digest in written.items():
        assert sha(client.get_object(Bucket=bucket, Key=prefix + name)["Body"].read()) == digest, name
    delete_bucket(seaweed_server, bucket)


class _Hub(http.server.BaseHTTPRequestHandler):
    """The two requests of huggingface_hub's hf_hub_download, as the Hub answers them: HEAD and GET of
    /{repo}/resolve/{revision}/{file}, with the commit and the file's sha256 as its ETag."""

    files: dict[str, bytes] = {}

    def _answer_head(self) -> bytes | None:
        body = self.files.get(self.path.split("?")[0].rpartition("/")[2])
        self.send_response(200 if body is not None else 404)
        if body is not None:
            self.send_header("X-Repo-Commit", "0123456789abcdef0123456789abcdef01234567")
            self.send_header("ETag", f'"{hashlib.sha256(body).hexdigest()}"')
        self.send_header("Content-Length", str(len(body or b"")))
        self.end_headers()
        return body

    def do_HEAD(self) -> None:  # noqa: N802 - the name http.server calls
        self._answer_head()

    def do_GET(self) -> None:  # noqa: N802
        body = self._answer_head()
        if body is not None:
            self.wfile.write(body)

    def log_message(self, *args: object) -> None:
        pass


HF_DOWNLOAD = """
    import json, sys
    from huggingface_hub import hf_hub_download
    print(json.dumps([hf_hub_download("org/model", name, local_dir=sys.argv[1]) for name in sys.argv[2:]]))
"""


@pytest.mark.parametrize("allow_overwrite", [False, True])
def test_hf_hub_download_into_a_writable_mount(seaweed_server: S3Server, mountpoint: Path,
                                               allow_overwrite: bool) -> None:
    """`hf_hub_download(local_dir=...)` (and `hf download --local-dir`), the usual way to put a model into a
    directory, into a new directory of a --writable mount: it takes a lock file of its own under
    `.cache/huggingface/download/` (filelock: open O_RDWR|O_CREAT, flock, close), reads its metadata, then takes
    the same lock again to download. The second open of the lock file, stored (empty) at the first close, opens an
    existing file for writing without O_TRUNC. Without --allow-overwrite that open is a touch (writes.py): it was
    EPERM, and nothing was downloaded. With or without the flag, every file arrives whole."""
    files = {"config.json": b'{"model_type": "llama"}\n', "model.safetensors": os.urandom(100_000)}
    bucket = new_bucket(seaweed_server)
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), type("Hub", (_Hub,), {"files": files}))
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    args = ("--writable", "--allow-overwrite") if allow_overwrite else ("--writable",)
    try:
        with mounted(seaweed_server, bucket, mountpoint, *args, allowed=(r"--allow-delete",)):
            where = mountpoint / "models" / "org model"
            res = subprocess.run([sys.executable, "-c", textwrap.dedent(HF_DOWNLOAD), str(where), *files],
                                 capture_output=True, text=True, timeout=60,
                                 env={**os.environ, "HF_ENDPOINT": f"http://127.0.0.1:{server.server_address[1]}"})
            assert res.returncode == 0, res.stderr[-2000:]
            assert {name: (where / name).read_bytes() for name in files} == files
    finally:
        server.shutdown()
        server.server_close()
        thread.join()
    delete_bucket(seaweed_server, bucket)


# -- the errors a new user meets on the way ---------------------------------------------------------

@pytest.mark.parametrize("status", [404, 400])
def test_an_endpoint_that_is_not_s3_is_not_said_to_lack_the_bucket(seaweed_server: S3Server, tmp_path: Path,
                                                                   status: int) -> None:
    """A SeaweedFS user gives the filer's port (8888) for the S3 one (8333): every request gets a plain 404. The mount
    said "bucket 'models' does not exist" of a bucket that exists, and the user went looking for a typo in its
    name (the volume server's port: "400 (Bad Request)"). Only an S3 answer (NoSuchBucket) says the bucket is
    missing; an answer without an S3 error code says the endpoint may not be the S3 API."""
    bucket = new_bucket(seaweed_server)
    mp = tmp_path / "mnt"
    mp.mkdir()
    with not_an_s3_server(status) as url:
        res = run_modelfs("mount", bucket, str(mp), "--endpoint-url", url, env=daemon_env(seaweed_server))
    assert res.returncode == 1 and len(res.stderr.strip().splitlines()) == 1, res.stderr
    assert "does not exist" not in res.stderr and f"{url} answered {status} without an S3 error: is it the S3 API" \
        in res.stderr, res.stderr
    assert not os.path.ismount(mp)
    res = run_modelfs("mount", f"{bucket}-typo", str(mp), "--endpoint-url", seaweed_server.endpoint_url,
                      env=daemon_env(seaweed_server))
    assert res.returncode == 1 and f"bucket '{bucket}-typo' does not exist" in res.stderr, res.stderr
