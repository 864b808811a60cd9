#!/usr/bin/env bash
# The bench on a many-core machine that cannot reach a package registry (the device machine of
# bench/README.md: 16 cores, Python 3.12, no apt or pip there). Two halves:
#
#   bash bench/device.sh kit    here, with the registries: fills .device-kit/ (git-ignored, < 60 MiB) with
#                               what that machine lacks: the pure-Python wheels of modelfs's dependencies,
#                               pyfuse3's source and the wheels that build it (it has no cp312 wheel),
#                               libfuse3 and fusermount3 as .deb files, and the `weed` binary, xz-compressed
#   bash bench/device.sh run    there, in a copy of this repo with .device-kit carried beside it: installs
#                               all of it without a network (debs unpacked under /tmp, never over /), builds
#                               pyfuse3, then runs the benches, each under a time limit, their JSON and logs
#                               in $OUT (else bench/out/device)
#
# KIT_PYTHON_VERSION (default 3.12) is the target's Python; the kit's wheels are pure Python except Cython's.
# DEVICE_SIZE (default 2G) and DEVICE_ROUNDS (default 2) size the run; DEVICE_STAGES (default run,gil; also
# quick, and ab: `bench/ab.py --no-pin $DEVICE_AB_ARGS`, its variants' source trees carried beside the repo)
# picks the stages. The default stages end within about 7 minutes of the call's start, install included.
set -euo pipefail

ROOT=$(cd "$(dirname "$0")/.." && pwd)
KIT=${DEVICE_KIT:-$ROOT/.device-kit}
# modelfs's dependencies at the versions this repo tests with (xxhash, numpy, safetensors and matplotlib are on
# the device's image), and what builds pyfuse3 there: setuptools, setuptools_scm, Cython.
WHEELS="trio==0.35.0 outcome==1.3.0.post0 sniffio==1.3.1 boto3==1.44.8 botocore==1.44.8 s3transfer==0.19.3
jmespath==1.1.0 cachetools==8.0.2 attrs==26.1.0 sortedcontainers==2.4.0 idna==3.20 urllib3==2.8.0 six==1.17.0
python-dateutil==2.9.0.post0 tqdm==4.70.1 prometheus_client==0.26.0
setuptools==80.9.0 setuptools_scm==8.3.1 packaging==25.0 Cython==3.1.2"
PYFUSE3=pyfuse3==3.5.0
DEBS="libfuse3-3 libfuse3-dev fuse3"
KIT_LIMIT_MIB=60

log() { echo "[device.sh $(date +%T)] $*" >&2; }

make_kit() {
    local py=${KIT_PYTHON_VERSION:-3.12} pip="$ROOT/.venv/bin/python -m pip"
    rm -rf "$KIT" && mkdir -p "$KIT/wheels" "$KIT/sdist" "$KIT/debs"
    log "wheels for CPython $py (x86-64)"
    # shellcheck disable=SC2086 # word splitting of the lists is wanted
    $pip download -q --no-deps --only-binary=:all: --python-version "$py" --implementation cp \
        --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
        -d "$KIT/wheels" $WHEELS
    $pip download -q --no-deps --no-binary=:all: -d "$KIT/sdist" "$PYFUSE3"
    log "debs: $DEBS"
    # shellcheck disable=SC2086
    (cd "$KIT/debs" && apt-get download $DEBS >/dev/null)
    log "weed (xz)"
    xz -6 -T2 -c "$(command -v weed || echo "$ROOT/.venv/bin/weed")" >"$KIT/weed.xz"
    local mib
    mib=$(du -sm "$KIT" | cut -f1)
    log "kit: $mib MiB in $KIT"
    if ((mib > KIT_LIMIT_MIB)); then
        log "over $KIT_LIMIT_MIB MiB: the device carries 64 MiB with the repo" && exit 1
    fi
}

# pyfuse3's build asks pkg-config for fuse3's flags; this answers for the headers unpacked under $1, and links
# the library by its soname (the -dev package's libfuse3.so points at /lib, absolute, outside $1).
pkg_config_shim() {
    local root=$1 bin=$1/shim
    mkdir -p "$bin"
    cat >"$bin/pkg-config" <<EOF
#!/bin/sh
for a in "\$@"; do
    case "\$a" in
        --cflags) echo "-I$root/usr/include/fuse3"; exit 0 ;;
        --libs) echo "-L$root/lib/x86_64-linux-gnu -l:libfuse3.so.3 -lpthread"; exit 0 ;;
        --modversion) echo 3.14.0; exit 0 ;;
    esac
done
exit 0
EOF
    chmod +x "$bin/pkg-config"
    echo "$bin"
}

install_kit() {
    local py=$1 root=/tmp/device-root
    [ -d "$KIT/wheels" ] || { log "no kit at $KIT: run 'bash bench/device.sh kit' where pip works, carry .device-kit"; exit 2; }
    mkdir -p "$root"
    local deb
    for deb in "$KIT"/debs/*.deb; do
        if command -v dpkg >/dev/null; then dpkg -x "$deb" "$root"; else "$py" - "$deb" "$root" <<'PY'; fi
# No dpkg: a .deb is an ar archive whose data.tar.* member holds the files.
import io, sys, tarfile
blob = open(sys.argv[1], "rb").read()
pos = 8  # after the "!<arch>\n" magic; each member has a 60-byte header, its size in bytes 48..58
while pos < len(blob):
    name, size = blob[pos:pos + 16].strip().decode(), int(blob[pos + 48:pos + 58])
    if name.startswith("data.tar"):
        tarfile.open(fileobj=io.BytesIO(blob[pos + 60:pos + 60 + size])).extractall(sys.argv[2], filter="tar")
    pos += 60 + size + size % 2
PY
    done
    export PATH="$root/usr/bin:$root/bin:$(pkg_config_shim "$root"):$PATH"
    export LD_LIBRARY_PATH="$root/lib/x86_64-linux-gnu${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
    log "installing the wheels into $($py -c 'import sys; print(sys.prefix)')"
    $py -m pip install -q --no-index --no-deps --no-cache-dir "$KIT"/wheels/*.whl
    log "building pyfuse3 against the unpacked libfuse3"
    $py -m pip install -q --no-index --no-deps --no-cache-dir --no-build-isolation "$KIT"/sdist/pyfuse3-*.tar.gz
    mkdir -p "$root/usr/bin"
    $py -c 'import lzma, shutil, sys; shutil.copyfileobj(lzma.open(sys.argv[1]), open(sys.argv[2], "wb"))' \
        "$KIT/weed.xz" "$root/usr/bin/weed"
    chmod +x "$root/usr/bin/weed"
    $py -m pip install -q --no-index --no-deps --no-cache-dir --no-build-isolation -e "$ROOT"
    $py -c "import pyfuse3, trio, boto3, fsmount; print('pyfuse3', pyfuse3.__version__, 'libfuse', end=' ')" >&2
    ldd "$($py -c 'import pyfuse3; print(pyfuse3.__file__)')" | grep fuse >&2
}

# One stage: its command under a time limit; its output kept whatever happens.
stage() {
    local name=$1 limit=$2
    shift 2
    log "stage $name (at most ${limit}s): $*"
    local rc=0
    timeout --kill-after=20 "$limit" "$@" >"$OUT/$name.log" 2>&1 || rc=$?
    log "stage $name: exit $rc; last lines:"
    tail -n 25 "$OUT/$name.log" >&2
}

run_device() {
    local py=${DEVICE_PYTHON:-python3}
    OUT=${OUT:-$ROOT/bench/out/device}
    mkdir -p "$OUT"
    export PYTHONUNBUFFERED=1
    {
        echo "cpus $(nproc); $(uname -r); $($py --version 2>&1)"
        grep -m1 "model name" /proc/cpuinfo || true
        grep -E "MemTotal|MemAvailable" /proc/meminfo
        ls -l /dev/fuse 2>&1 || true
    } | tee "$OUT/machine.txt" >&2
    [ -e /dev/fuse ] || modprobe fuse 2>/dev/null || true
    [ -e /dev/fuse ] || mknod -m 666 /dev/fuse c 10 229 2>/dev/null || true
    install_kit "$py"
    local size=${DEVICE_SIZE:-2G} rounds=${DEVICE_ROUNDS:-2} stages=${DEVICE_STAGES:-run,gil}
    cd "$ROOT"
    # A smoke test of the install (32M models, one round): not in the default stages, which fit one call.
    # Its log alone goes to $OUT: 8 files come back at most (machine.txt, run.log, results.json/.md/.png, gil.log).
    if [[ ,$stages, == *,quick,* ]]; then
        stage quick 120 "$py" bench/run.py --quick --no-pin --only get-floor,fuse-floor,modelfs --out /tmp/quick.json
    fi
    # The unpinned bed: SeaweedFS and the clients share every core, as on a GPU node with a nearby origin.
    if [[ ,$stages, == *,run,* ]]; then
        stage run 270 "$py" bench/run.py --no-pin --models single --scenarios cat,load_file,safe_open \
            --only curl,get-floor,fuse-floor,local-disk,modelfs,modelfs-warm --size "$size" --rounds "$rounds" \
            --out "$OUT/results.json"
    fi
    # The GIL's share per path, and model streaming's own rate with one push at a time against the
    # PARALLEL_PUSHES that a daemon with this many CPUs gets (pagecache.py).
    if [[ ,$stages, == *,gil,* ]]; then
        local one=/tmp/one-push
        rm -rf "$one" && mkdir -p "$one" && cp -r fsmount "$one/"
        sed -i 's/^PARALLEL_PUSHES = .*/PARALLEL_PUSHES = 1/' "$one/fsmount/pagecache.py"
        stage gil 150 "$py" bench/ab.py --no-pin --variant one="$one" --variant parallel=. \
            --scenarios cold,cold_stream,fill,warm,warm_stream --rounds 1 --size "$size" --gil
    fi
    # An A/B of the caller's choosing (variants, scenarios), e.g. this tree against an earlier one carried along.
    if [[ ,$stages, == *,ab,* ]]; then
        # shellcheck disable=SC2086 # DEVICE_AB_ARGS is a list of arguments
        stage ab "${DEVICE_AB_LIMIT:-300}" "$py" bench/ab.py --no-pin --size "$size" --rounds "$rounds" $DEVICE_AB_ARGS
    fi
    log "done; results in $OUT"
}

case ${1:-} in
    kit) make_kit ;;
    run) run_device ;;
    *) echo "usage: bash bench/device.sh kit|run" >&2 && exit 2 ;;
esac
