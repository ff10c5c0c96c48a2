#!/usr/bin/env bash
# The GPU runs behind BENCHMARKS.md's device-path section, on a 2-GPU host with nixl installed
# and this checkout on PYTHONPATH (see BENCHMARKS.md for the setup lines). Logs go to $LOGS.
#   bash benchmarks/gpu_suite.sh smoke   # a few GPU tests of the device path
#   bash benchmarks/gpu_suite.sh bench   # bench_nixl.py: two GPUs, then one GPU, two processes
#   bash benchmarks/gpu_suite.sh tests   # plugins/kvxfer_nixl/tests/test_nixl_backend.py + tests/test_cuda_gpu.py
#   bash benchmarks/gpu_suite.sh security  # device-path attacks (widened allocation, handle poisoning), one GPU
#   bash benchmarks/gpu_suite.sh fixedcost   # bench_fixed_cost_gpu.py (the device path's event wait against a bare
#       copy: torch, copier, path wait, path poll, verified, copy+digest, us and +torch per 4 KB/64 KB/4.5 MB block),
#       then bench_fixed_cost.py through the Agent and the Owner (host and device path), the owner's VRAM conformance
#   bash benchmarks/gpu_suite.sh store   # benchmarks/gpu_store.sh: VRAM store test, GB/s, the GDS probe (one GPU)
#   bash benchmarks/gpu_suite.sh digest  # the device path's kernels: GPU tests + their CPU models (wait, fence,
#       verified post, tensor-core mm8 model), then bench_digest_gpu.py: copy, mm8 tc/dp4a/torch and fused GB/s,
#       "fused +" = a verified copy's cost over a plain one (one GPU)
#   bash benchmarks/gpu_suite.sh verified  # bench_integrity.py on VRAM: verified against unverified reads (one GPU)
set -u
LOGS=${LOGS:-${OUT:-/tmp}}
export PYTHONUNBUFFERED=1
B="python3 benchmarks/bench_nixl.py --memory VRAM --iters 5 --small-iters 200"
T="python3 -m pytest -q -p no:cacheprovider -rfE"
for stage in "$@"; do
  case $stage in
    info)
      nvidia-smi topo -m
      python3 -c "import torch; print(torch.__version__, torch.version.cuda, torch.cuda.device_count())" ;;
    security)
      timeout 240 $T tests/test_cuda_security_gpu.py tests/test_cuda_identity.py -v 2>&1 | tee $LOGS/security.txt ;;
    smoke)
      timeout 150 $T tests/test_cuda_gpu.py -k "cuda_ipc_path or restarted or expandable" 2>&1 | tee $LOGS/smoke.txt ;;
    bench)
      timeout 150 $B --local-gpu 0 --remote-gpu 1 --modes rows,layers --write \
        --variants kvxfer,kvxfer-ce,kvxfer-nixl --json $LOGS/two_gpus.json 2>&1 | tee -a $LOGS/bench.txt
      timeout 120 $B --local-gpu 0 --remote-gpu 0 --modes rows,layers --write \
        --variants kvxfer,kvxfer-ce --json $LOGS/one_gpu.json 2>&1 | tee -a $LOGS/bench.txt ;;
    fixedcost)
      timeout 120 python3 benchmarks/bench_fixed_cost_gpu.py --json $LOGS/fixed_gpu.json 2>&1 | tee $LOGS/fixed_gpu.txt
      for m in ${FIXED_MEMS:-DRAM VRAM}; do
        timeout 120 python3 benchmarks/bench_fixed_cost.py --memory $m --contention ${FIXED_ARGS:-} --json $LOGS/fixed_$m.json 2>&1 \
          | tee $LOGS/fixed_$m.txt
      done
      timeout 120 $T plugins/kvxfer_nixl/tests/test_nixl_backend.py -k "VRAMOwner" 2>&1 | tee $LOGS/owner_vram.txt ;;
    digest)
      timeout 120 $T tests/test_cuda_digest_gpu.py tests/test_cuda_prepared.py tests/test_cuda_wait.py \
        tests/test_cuda_verified.py tests/test_cuda_mm8_model.py 2>&1 | tee $LOGS/digest_tests.txt
      timeout 150 python3 benchmarks/bench_digest_gpu.py --json $LOGS/digest.json 2>&1 | tee $LOGS/digest.txt ;;
    verified)
      timeout 150 python3 benchmarks/bench_integrity.py --memory VRAM --backends loopback,nixl --blocks 512 --request 256 \
        --layers 32 --page 65536 --iters 9 --json $LOGS/verified.json 2>&1 | tee $LOGS/verified.txt ;;
    store)
      LOGS=$LOGS bash benchmarks/gpu_store.sh ;;
    tests)
      timeout 300 $T tests/test_cuda_gpu.py tests/test_cuda_path.py -k "not killed" 2>&1 | tee $LOGS/tests_path.txt
      timeout 300 $T plugins/kvxfer_nixl/tests/test_nixl_backend.py 2>&1 | tee $LOGS/tests_nixl.txt
      timeout 120 $T tests/test_cuda_gpu.py -k killed 2>&1 | tee $LOGS/killed.txt ;;
  esac
done
