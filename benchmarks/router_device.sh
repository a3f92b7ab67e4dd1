#!/usr/bin/env bash
# The router overhead benchmark (benchmarks/router_overhead.py: pdpool router and both peers in one run) on the
# host of a lent GPU machine (16 cores), where the router, the two stubs, Redis and the load generator do not
# compete for 2 cores as they do on the development machine. No GPU is used; the lent machine is only a host with
# free cores. It has Python 3.12 and no registry access, so everything it lacks travels in .bench_router/
# (ignored by git; the device tool carries it, 64 MiB at most for everything that travels).
#
#   benchmarks/router_device.sh prepare        # here, with registry access: fills .bench_router/
#   # then, on the lent machine (device tool `run`, carry [".bench_router"], repo root as cwd):
#   set -o pipefail; bash .bench_router/run_router_device.sh run 2>&1 | tee $OUT/device.log
#   bash .bench_router/run_router_device.sh run --rates 200 --seconds 3    # other benchmark arguments
#   RB_SCRIPT=router_overhead_interleaved.py bash .bench_router/run_router_device.sh run --rounds 8  # interleaved
#
# prepare: cp312 manylinux x86_64 wheels of the peers at the versions measured on the development machine
# (/tmp/router-bench-venvs, `pip freeze`) and their dependencies, and of what pdpool's router path needs that the
# image lacks (httptools, redis-py; its other needs, aiohttp, uvloop, tokenizers, prometheus-client, pyyaml,
# jinja2, are in the image); Debian's redis-server with its two libraries the image may lack (jemalloc, lzf); the
# demo model's tokenizer and config files (`--model demo` resolves to $PDPOOL_CACHE/models/<folder>, and the
# router reads no weights); and a copy of this script as .bench_router/run_router_device.sh. The peers' Rust
# extensions are stripped of their symbol tables (`strip --strip-unneeded`: the code is unchanged, 8 MB less to
# carry), because with them everything that travels is within 3 MiB of the 64 MiB limit.
#
# run: unpacks Redis, makes one venv for pdpool and one per peer (--system-site-packages, plus a .pth to the
# image's python3 site-packages, which is itself a venv's, so that the image's packages are seen), installs from
# the carried wheels only (pip --no-index), installs pdpool from the travelling tree (editable), prints the host
# (cores, CPU model, boot id, steal), then runs the benchmark with the brief's arguments and writes its output,
# the host's CPU counters and the processes' logs under $OUT.
set -euo pipefail

SGLANG_ROUTER=0.3.2     # as in /tmp/router-bench-venvs/sglang-router (pip freeze)
VLLM_ROUTER=0.1.17      # as in /tmp/router-bench-venvs/vllm-router
BENCH_ARGS=(--rates 200 1000 --seconds 20 --workers 1 2 --clients 32)

sources() {   # one hash of the code that runs, to tie a device run to this machine's tree
    (cd "$1" && find pdpool router benchmarks -name '*.py' -o -name '*.c' | LC_ALL=C sort | xargs sha256sum | sha256sum | cut -c1-16)
}

prepare() {
    local root d py plat model
    root=$(git rev-parse --show-toplevel)
    d=$root/.bench_router
    py=${PY:-$root/.venv/bin/python}
    rm -rf "$d/wheels" "$d/debs" "$d/model"
    mkdir -p "$d/wheels" "$d/debs" "$d/model"
    plat=(--python-version 3.12 --implementation cp --only-binary=:all:)
    for p in manylinux_2_34 manylinux_2_31 manylinux_2_28 manylinux_2_27 manylinux_2_24 manylinux_2_17 manylinux2014 \
             manylinux_2_5 manylinux1; do plat+=(--platform "${p}_x86_64"); done
    # the peers' dependencies at the versions of their venvs here where those exist (a constraints file), and
    # httptools and redis-py at the versions of the development venv, so both machines run the same code
    for v in /tmp/router-bench-venvs/*/; do
        if [ -x "$v/bin/python" ]; then (cd /tmp && "$v/bin/python" -m pip freeze --exclude-editable); fi
    done | { grep -v 'router' || true; } | sort -u > "$d/constraints.txt"
    "$py" -m pip download -q "${plat[@]}" -d "$d/wheels" -c "$d/constraints.txt" \
        "sglang-router==$SGLANG_ROUTER" "vllm-router==$VLLM_ROUTER" \
        "httptools==$("$py" -c 'import importlib.metadata as m; print(m.version("httptools"))')" \
        "redis==$("$py" -c 'import importlib.metadata as m; print(m.version("redis"))')"
    "$py" - "$d/wheels" <<'EOF'
import base64, hashlib, os, subprocess, sys, tempfile, zipfile
from pathlib import Path

for whl in sorted(Path(sys.argv[1]).glob("*_router-*.whl")):   # sglang_router-*, vllm_router-*
    src = zipfile.ZipFile(whl)
    entries = {info.filename: (info, src.read(info)) for info in src.infolist()}
    for name, (info, data) in list(entries.items()):
        if name.endswith(".so") and len(data) > 10_000_000:
            with tempfile.TemporaryDirectory() as tmp:
                path = os.path.join(tmp, "x.so")
                Path(path).write_bytes(data)
                subprocess.run(["strip", "--strip-unneeded", path], check=True)
                entries[name] = (info, Path(path).read_bytes())
            print(f"{whl.name}: {name} {len(data)} -> {len(entries[name][1])} bytes (stripped)")
    record = next(n for n in entries if n.endswith(".dist-info/RECORD"))
    lines = []
    for line in entries[record][1].decode().splitlines():
        name = line.rsplit(",", 2)[0]
        if name in entries and name != record:
            digest = base64.urlsafe_b64encode(hashlib.sha256(entries[name][1]).digest()).rstrip(b"=").decode()
            line = f"{name},sha256={digest},{len(entries[name][1])}"
        lines.append(line)
    entries[record] = (entries[record][0], ("\n".join(lines) + "\n").encode())
    tmp = whl.with_suffix(".tmp")
    with zipfile.ZipFile(tmp, "w", zipfile.ZIP_DEFLATED) as out:
        for info, data in entries.values():
            out.writestr(info, data, compress_type=zipfile.ZIP_DEFLATED)
    src.close()
    os.replace(tmp, whl)
EOF
    (cd "$d/debs" && apt-get download -q redis-server redis-tools libjemalloc2 liblzf1 2>&1 | grep -v '^W: Download is performed unsandboxed' || true)
    for f in "$d"/debs/*.deb; do mv "$f" "$d/debs/$(basename "$f" | cut -d_ -f1).deb"; done
    model=$(cd /tmp && "$py" -c 'from pdpool.models.demo import ensure_demo_model; print(ensure_demo_model())')
    find "$model" -maxdepth 1 -type f ! -name '*.safetensors' -exec cp {} "$d/model/" \;
    gzip -9 "$d/model/tokenizer.json"
    echo "$(basename "$model")" > "$d/model/FOLDER"
    cp "$root/benchmarks/router_device.sh" "$d/run_router_device.sh"
    du -sb "$d"
    echo "what travels: $(( ($(git -C "$root" ls-files -z | xargs -0 du -cb | tail -1 | cut -f1) \
        + $(du -sb "$d" | cut -f1)) / 1048576 )) MiB + untracked files (limit 64 MiB)"
}

run() {
    local root d w py sites venv sp p a b
    root=$PWD
    d=$root/.bench_router
    w=${RB_WORK:-/tmp/router-device}
    py=${RB_PYTHON:-$(command -v python3)}
    : "${OUT:?OUT must name the folder for results}"
    [ $# -gt 0 ] || set -- "${BENCH_ARGS[@]}"
    cd /tmp   # the checkout's operator/ folder would shadow the standard library's in `python -c`/`-m` run from it
    rm -rf "$w"
    mkdir -p "$w/bin" "$w/venvs"

    echo "== host"
    date -u
    echo "nproc (OMP_NUM_THREADS unset): $(env -u OMP_NUM_THREADS nproc); OMP_NUM_THREADS=${OMP_NUM_THREADS-unset}"
    lscpu | grep -E '^(Model name|CPU\(s\)|On-line CPU|Thread|Core|Socket|NUMA node\(s\)|Hypervisor|CPU max MHz)' || true
    echo "boot id: $(cat /proc/sys/kernel/random/boot_id)"
    echo "kernel: $(uname -r)"
    echo "cgroup cpu.max: $(cat /sys/fs/cgroup/cpu.max 2>/dev/null || echo none)"
    echo "Cpus_allowed_list: $(grep Cpus_allowed_list /proc/self/status | cut -f2)"
    echo "loadavg: $(cat /proc/loadavg)"
    nvidia-smi -L 2>/dev/null || true
    echo "python: $py $("$py" -c 'import sys; print(sys.version.split()[0], sys.prefix, sys.base_prefix)')"
    echo "cc: $(command -v cc || echo none)"
    echo "sources (sha256 of pdpool/, router/ and benchmarks/ *.py and *.c, as \`benchmarks/router_device.sh sources\`" \
         "prints here): $(sources "$root")"

    echo "== redis"
    for f in "$d"/debs/*.deb; do dpkg -x "$f" "$w/redis"; done
    printf '#!/bin/sh\nLD_LIBRARY_PATH=%s${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH} exec %s "$@"\n' \
        "$w/redis/usr/lib/x86_64-linux-gnu" "$w/redis/usr/bin/redis-server" > "$w/bin/redis-server"
    chmod +x "$w/bin/redis-server"
    "$w/bin/redis-server" --version

    echo "== venvs"
    # the image's python3 is a venv's (/opt/torch/.venv): --system-site-packages alone would show its base
    # interpreter's packages, not the image's, so a .pth adds the image's site-packages after the venv's own
    sites=$("$py" -c 'import sysconfig; p = sysconfig.get_paths(); print(p["purelib"]); print(p["platlib"])' | sort -u)
    for venv in pdpool vllm-router sglang-router; do
        "$py" -m venv --without-pip --system-site-packages "$w/venvs/$venv"
        sp=$("$w/venvs/$venv/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
        printf '%s\n' $sites > "$sp/_image_site_packages.pth"
    done
    pip_install() { "$w/venvs/$1/bin/python" -m pip install -q --no-index --find-links "$d/wheels" --no-compile \
        --disable-pip-version-check "${@:2}"; }
    pip_install vllm-router "vllm-router==$VLLM_ROUTER" & a=$!
    pip_install sglang-router "sglang-router==$SGLANG_ROUTER" & b=$!
    pip_install pdpool httptools 'redis>=5' 'aiohttp>=3.9' 'uvloop>=0.18' tokenizers jinja2 pyyaml prometheus-client
    wait $a || echo "vllm-router NOT installed: its rows will be missing"
    wait $b || echo "sglang-router NOT installed: its rows will be missing"
    p=$w/venvs/pdpool/bin/python
    "$p" -m pip install -q --no-index --no-deps --no-build-isolation --disable-pip-version-check -e "$root"
    "$p" -c 'import importlib.metadata as m
for n in ("aiohttp", "uvloop", "httptools", "redis", "tokenizers", "prometheus-client", "pyyaml", "jinja2"):
    print(n, m.version(n))'
    for venv in vllm-router sglang-router; do
        "$w/venvs/$venv/bin/python" -c "import importlib.metadata as m; print('$venv', m.version('$venv'))"
    done

    echo "== model, native piece table"
    export PDPOOL_CACHE=$w/cache
    mkdir -p "$PDPOOL_CACHE/models/$(cat "$d/model/FOLDER")"
    cp "$d"/model/* "$PDPOOL_CACHE/models/$(cat "$d/model/FOLDER")/"
    gunzip "$PDPOOL_CACHE/models/$(cat "$d/model/FOLDER")/tokenizer.json.gz"
    "$p" -m pdpool.native_text || echo "native piece table NOT built: the router tokenizes in Python"

    local script=${RB_SCRIPT:-router_overhead.py}   # or router_overhead_interleaved.py (its own arguments)
    if [ "$script" != router_overhead.py ] && [ "$*" = "${BENCH_ARGS[*]}" ]; then set --; fi   # its own defaults
    echo "== benchmark: $script $*"
    head -1 /proc/stat > "$OUT/proc_stat_before.txt"
    date -u
    PYTHONUNBUFFERED=1 "$p" "$root/benchmarks/$script" "$@" --venvs "$w/venvs" \
        --redis-server "$w/bin/redis-server" --logs "$w/logs" | tee "$OUT/${script%.py}.out"
    date -u
    head -1 /proc/stat > "$OUT/proc_stat_after.txt"
    echo "host cpu line before/after (user nice system idle iowait irq softirq steal):"
    cat "$OUT/proc_stat_before.txt" "$OUT/proc_stat_after.txt"
    tar czf "$OUT/logs.tgz" -C "$w" logs
}

"$@"
