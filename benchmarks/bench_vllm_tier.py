"""KvxferStoreTier against vLLM's own ``fs`` tier, side by side in one run (vLLM venv).

    PYTHONPATH=.:plugins .venv-vllm/bin/python benchmarks/bench_vllm_tier.py [--dir /tmp] [--row-kib 512]
        [--chunks 128] [--per-request 16] [--repeat 3] [--threads 4] [--fs-direct both|off|on]

Both tiers get the same primary view (``--chunks`` rows of ``--row-kib``, as vLLM's CPU
primary hands a secondary tier), the same requests (``--per-request`` chunks each, every
chunk of the primary once per round) and the same thread count. A round stores every chunk
under fresh keys and drains, then loads them all back into the primary refilled with 0xAA
and drains; bytes are checked against the pattern every round. Reported: store and load
GB/s (median round), files created per request, and read/write system calls per request
(``syscr``/``syscw`` of ``/proc/self/io``: every read, write, readv, writev, preadv, pwritev),
then what a byte flipped on disk gives each tier (bytes served that differ from what was stored).
Both tiers' files sit on the same file system. The store's I/O is buffered (docs/storage.md,
"O_DIRECT"); vLLM's fs tier uses ``O_DIRECT`` wherever its probe finds the file system takes
it, so a like-for-like comparison turns that off: ``--fs-direct off`` runs the fs tier buffered
(the same flags as the store), ``on`` as vLLM configures it, ``both`` (the default) shows both rows.
"""

from __future__ import annotations

import argparse
import hashlib
import mmap
import os
import shutil
import statistics
import tempfile
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np

from kvxfer.integrations.vllm.tier import KvxferStoreTier
from vllm.v1.kv_offload.base import ReqContext, make_offload_key
from vllm.v1.kv_offload.tiering.base import TransferJob
from vllm.v1.kv_offload.tiering.fs.manager import FileSystemTierManager


def _spec() -> Any:
    """What the fs tier reads of vLLM's offloading spec (its file mapper's facts)."""
    parallel = SimpleNamespace(tp_size=1, pp_size=1, pcp_size=1, dcp_size=1, rank=0, is_parallelism_agnostic=True)
    config = SimpleNamespace(groups=[SimpleNamespace(tokens_per_block=16, layer_names=["layer.0"])], parallel=parallel,
                             canonical_layout=False, replicated_layout=False, kv_cache_layout=None,
                             model=SimpleNamespace(name="bench", dtype="float16"), cache=SimpleNamespace(tokens_per_hash=16))
    return SimpleNamespace(config=config, blocks_per_chunk=1, kv_events_config=SimpleNamespace(enable_kv_cache_events=False))


def _io() -> int:
    with open("/proc/self/io") as f:
        d = dict(line.split(": ") for line in f.read().splitlines())
    return int(d["syscr"]) + int(d["syscw"])


def _files(root: str) -> int:
    return sum(len(fs) for _, _, fs in os.walk(root))


def _run(name: str, tier: Any, arr: np.ndarray, root: str, per: int, repeat: int) -> dict[str, Any]:
    n, row = arr.shape
    ctx = ReqContext(req_id="bench")
    jid = [0]
    src = np.random.default_rng(1).integers(0, 256, arr.shape, dtype=np.uint8)

    def jobs(keys: list[bytes], promo: bool) -> float:
        t0 = time.perf_counter()
        for i in range(0, n, per):
            jid[0] += 1
            submit = tier.submit_load if promo else tier.submit_store
            submit(TransferJob(jid[0], keys[i:i + per], np.arange(i, min(i + per, n)), promo, ctx))
        tier.drain_jobs()
        done = list(tier.get_finished_jobs())
        assert len(done) == -(-n // per) and all(r.success for r in done), done
        return time.perf_counter() - t0

    st, ld, calls = [], [], []
    files0 = _files(root)
    for r in range(repeat):
        keys = [make_offload_key(hashlib.sha256(f"{name}-{r}-{i}".encode()).digest(), 0) for i in range(n)]
        arr[:] = src
        io0 = _io()
        st.append(jobs(keys, False))
        arr[:] = 0xAA
        ld.append(jobs(keys, True))
        calls.append(_io() - io0)
        assert np.array_equal(arr, src), f"{name}: bytes differ after a round"
    reqs = 2 * -(-n // per)
    gb = arr.nbytes / 1e9
    files = (_files(root) - files0) / (repeat * -(-n // per))
    # a byte flipped on disk: every stored row of the last round, then load them back
    _flip(name, tier, root)
    arr[:] = 0xAA
    jid[0] += 1
    tier.submit_load(TransferJob(jid[0], keys[:per], np.arange(per), True, ctx))
    tier.drain_jobs()
    res = list(tier.get_finished_jobs())
    served = int(np.count_nonzero((arr[:per] != src[:per]) & (arr[:per] != 0xAA))) if res and res[0].success else 0
    wrong_rows = int(sum(not np.array_equal(arr[i], src[i]) for i in range(per))) if res and res[0].success else 0
    return {"tier": name, "store GB/s": gb / statistics.median(st), "load GB/s": gb / statistics.median(ld),
            "files created / store request": files, "read+write syscalls / request": statistics.median(calls) / reqs,
            "flip: job": "ok" if res and res[0].success else "failed (miss)",
            "flip: rows served wrong": wrong_rows, "flip: bytes served wrong": served}


def _flip(name: str, tier: Any, root: str) -> None:
    if name == "kvxfer":
        paths = [tier.store.path]
        stride, slots = tier.store.geometry.stride, tier.store.slots
        offs = [4096 + s * stride + 100 for s in range(slots)]
    else:
        paths = [str(p) for p in Path(root).rglob("*.bin")]
        offs = [100]
    for p in paths:
        with open(p, "r+b") as f:
            for o in offs:
                f.seek(o)
                b = f.read(1)
                if b:
                    f.seek(o)
                    f.write(bytes([b[0] ^ 0x5A]))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--dir", default=tempfile.gettempdir())
    ap.add_argument("--row-kib", type=int, default=512)
    ap.add_argument("--chunks", type=int, default=128)
    ap.add_argument("--per-request", type=int, default=16)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--threads", type=int, default=4)
    ap.add_argument("--fs-direct", choices=("both", "off", "on"), default="both")
    a = ap.parse_args()
    rows = []
    fs_rows = {"both": ["fs buffered", "fs O_DIRECT"], "off": ["fs buffered"], "on": ["fs O_DIRECT"]}[a.fs_direct]
    for name in (*fs_rows, "kvxfer"):
        mm = mmap.mmap(-1, a.chunks * (a.row_kib << 10))  # page-aligned, like vLLM's primary (O_DIRECT needs it)
        arr = np.frombuffer(mm, dtype=np.uint8).reshape(a.chunks, a.row_kib << 10)
        arr[:] = 0xAA
        root = tempfile.mkdtemp(prefix=f"bench-tier-{name}-", dir=a.dir)
        os.chmod(root, 0o700)
        try:
            if name.startswith("fs"):
                tier: Any = FileSystemTierManager(_spec(), memoryview(arr), "fs", root_dir=root,
                                                  n_read_threads=a.threads, n_write_threads=a.threads)
                direct = name == "fs O_DIRECT"
                if direct and not tier._use_o_direct:
                    raise SystemExit(f"{a.dir} does not take O_DIRECT: run with --fs-direct off")
                tier._use_o_direct = direct  # read per job by the fs tier (vLLM sets it from its probe)
            else:
                cap = (a.repeat + 1) * a.chunks * (-(-arr.shape[1] // 4096) * 4096)
                tier = KvxferStoreTier(_spec(), memoryview(arr), "kvxfer", store_path=root, capacity_bytes=cap,
                                       threads=a.threads)
            rows.append(_run(name, tier, arr, root, a.per_request, a.repeat))
            tier.shutdown()
        finally:
            shutil.rmtree(root, ignore_errors=True)
    print(f"{a.chunks} chunks of {a.row_kib} KiB, {a.per_request} per request, {a.threads} threads, "
          f"median of {a.repeat} rounds, dir {a.dir}; kvxfer buffered")
    cols = list(rows[0])
    print("| " + " | ".join(cols) + " |")
    print("|" + "---|" * len(cols))
    for r in rows:
        print("| " + " | ".join(f"{v:.2f}" if isinstance(v, float) else str(v) for v in r.values()) + " |")


if __name__ == "__main__":
    main()
