"""Does NIXL ``GDS`` move VRAM <-> a file here? Tried as cuFile is configured, then in cuFile's
compatibility mode (``allow_compat_mode`` in a cufile.json named by ``CUFILE_ENV_PATH_JSON``).

    python benchmarks/gds_probe.py [--dir /tmp] [--mib 64]

Each mode runs in a child process (cuFile reads its configuration once, at load): a NIXL
agent with the ``GDS`` plugin registers a CUDA buffer and a file, writes the buffer's seeded
bytes to the file, reads them back into a sentinel-filled buffer and compares. One JSON line
per mode: ``ok``, GB/s of each direction, or the error NIXL or cuFile gave. The store uses
``GDS`` only once this reports ``ok`` (docs/storage.md, "Data paths").
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

_CHILD = r"""
import json, os, sys, time
import numpy as np
import torch
import nixl._api as nx
path, nbytes = sys.argv[1], int(sys.argv[2])
out = {"mode": sys.argv[3]}
try:
    src = torch.randint(0, 256, (nbytes,), dtype=torch.uint8, device="cuda:0")
    dst = torch.full((nbytes,), 0xAA, dtype=torch.uint8, device="cuda:0")
    ag = nx.nixl_agent("gds-probe", nx.nixl_agent_config(backends=[]))
    ag.create_backend("GDS", {})
    fd = os.open(path, os.O_RDWR | os.O_CREAT | getattr(os, "O_DIRECT", 0), 0o600)
    os.posix_fallocate(fd, 0, nbytes)
    ag.register_memory([(src.data_ptr(), nbytes, 0, ""), (dst.data_ptr(), nbytes, 0, "")], "VRAM")
    ag.register_memory([(0, nbytes, fd, "")], "FILE")
    for op, buf in (("WRITE", src), ("READ", dst)):
        t0 = time.perf_counter()
        h = ag.initialize_xfer(op, ag.get_xfer_descs([(buf.data_ptr(), nbytes, 0)], "VRAM"),
                               ag.get_xfer_descs([(0, nbytes, fd)], "FILE"), "gds-probe")
        state = ag.transfer(h)
        while state not in ("DONE", "ERR"):
            state = ag.check_xfer_state(h)
        out[op.lower() + "_gbps"] = nbytes / (time.perf_counter() - t0) / 1e9
        ag.release_xfer_handle(h)
        if state != "DONE":
            raise RuntimeError(f"{op} ended in {state}")
    torch.cuda.synchronize()
    out["ok"] = bool(torch.equal(src, dst))
    out["control"] = bool(not torch.equal(src, torch.full_like(src, 0xAA)))
except Exception as exc:
    out["ok"], out["error"] = False, f"{type(exc).__name__}: {exc}"[:300]
print("RESULT " + json.dumps(out), flush=True)
"""


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--dir", default=tempfile.gettempdir())
    ap.add_argument("--mib", type=int, default=64)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory(dir=args.dir, prefix="kvxfer-gds-") as d:
        cfg = os.path.join(d, "cufile.json")
        with open(cfg, "w") as f:
            json.dump({"properties": {"allow_compat_mode": True}}, f)
        for mode, env in (("as configured", {}), ("allow_compat_mode", {"CUFILE_ENV_PATH_JSON": cfg})):
            t0 = time.time()
            r = subprocess.run([sys.executable, "-c", _CHILD, os.path.join(d, "gds.dat"), str(args.mib << 20), mode],
                               capture_output=True, text=True, env={**os.environ, **env}, timeout=300)
            line = [ln for ln in r.stdout.splitlines() if ln.startswith("RESULT ")]
            res = json.loads(line[0][7:]) if line else {"mode": mode, "ok": False,
                                                         "error": f"child rc={r.returncode}: {r.stderr[-300:]}"}
            res["seconds"] = round(time.time() - t0, 1)
            print(json.dumps(res), flush=True)


if __name__ == "__main__":
    main()
