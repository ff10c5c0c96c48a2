#!/usr/bin/env bash
# The KV store on the GPU machine (issue 22): VRAM offload/restore through the pinned host
# stage, byte-exact, then GB/s beside a plain device-to-host copy, then whether NIXL GDS loads
# (as configured and with cuFile's allow_compat_mode). Logs go to $LOGS.
#   bash benchmarks/gpu_store.sh      # or: bash benchmarks/gpu_suite.sh store
set -u
LOGS=${LOGS:-${OUT:-/tmp}}
export PYTHONUNBUFFERED=1
timeout 200 python3 -m pytest -q -p no:cacheprovider -rfE tests/test_store_vram.py 2>&1 | tee $LOGS/store_vram.txt
timeout 300 python3 benchmarks/bench_store_gpu.py --tokens 16384 --repeat 5 2>&1 | tee $LOGS/store_gpu.txt
timeout 200 python3 benchmarks/gds_probe.py 2>&1 | tee $LOGS/gds_probe.txt
