"""How long vLLM CPU engines take to start, alone and several at once (the suite's schedule).

``.venv-vllm/bin/python tests/vllm/start_times.py [--waves 1,2,4]``: for each wave size N,
starts N engines at once (a plain one for N=1, then kvxfer prefill/decode pairs, as the
tests configure them), waits until all are ready, prints the wall time and each engine's
own start time, and stops them before the next wave. Nothing is asserted: it is the
measurement behind the order the end-to-end tests start their engines in.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from e2e import TOKEN, kvxfer_config  # noqa: E402
from harness import TOKEN_ENV, free_port, start_engine, write_tiny_llama  # noqa: E402


def wave(model: Path, logdir: Path, n: int) -> tuple[float, list[float]]:
    t0 = time.monotonic()
    engines = []
    if n == 1:
        engines.append(start_engine("start-plain", model, logdir))
    else:
        for i in range(n // 2):
            port = free_port(2)
            for j, role in enumerate(("kv_producer", "kv_consumer")):
                engines.append(start_engine(f"start-{n}-{i}-{role}", model, logdir, env={TOKEN_ENV: TOKEN},
                                            kv_transfer_config=kvxfer_config(role, port + j)))
    try:
        for e in engines:
            e.wait_ready()
        return time.monotonic() - t0, [e.start_seconds or 0.0 for e in engines]
    finally:
        for e in engines:
            e.stop()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--waves", default="1,2,4")
    args = ap.parse_args()
    d = Path(tempfile.mkdtemp(prefix="kvxfer-start-times-"))
    model = write_tiny_llama(d / "tiny-llama")
    print(f"logs in {d}; load average before: {os.getloadavg()}")
    for n in (int(x) for x in args.waves.split(",")):
        wall, own = wave(model, d, n)
        print(f"{n} engine(s) at once: all ready after {wall:.1f} s; each engine's own LLM() time: "
              + ", ".join(f"{s:.1f}" for s in own) + f"; load average {os.getloadavg()[0]:.1f}", flush=True)


if __name__ == "__main__":
    main()
