#!/usr/bin/env bash
# Everything the device-path issue asks of one GPU, in one device call of under 10 minutes, most
# important first (a stage cut short by the overall limit leaves the earlier stages' logs):
# the kernels' tests and digest GB/s, the fixed cost (VRAM, profiled), verified VRAM reads, then
# every GPU test file, the GDS probe, and the DRAM fixed cost. Needs the cp312 wheels in .whl/.
#   bash benchmarks/gpu_oneshot.sh     # logs in $OUT/logs.tgz, summaries on stdout
# It prints, in order: the GPU and torch; the kernel tests' pass/skip line; bench_digest_gpu.py's
# table (copy, mm8 tc/dp4a/torch, fused GB/s, "fused +" = verified over unverified copy); the
# device path's fixed cost beside a bare copy (bench_fixed_cost_gpu.py: us and +torch per size);
# the Agent/Owner fixed cost (bench_fixed_cost.py) and the VRAM Owner tests; verified against
# unverified VRAM reads (bench_integrity.py); each GPU test file's pass/skip line; the GDS probe.
set -u
export PYTHONUNBUFFERED=1
python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl 2>&1 | tail -1
export PYTHONPATH=/tmp/site:$PWD:$PWD/plugins
D=/tmp/site/kvxfer-0.1.0.dist-info; mkdir -p $D
printf 'Metadata-Version: 2.1\nName: kvxfer\nVersion: 0.1.0\nRequires-Dist: nixl>=1.5; extra == "nixl"\n' > $D/METADATA
printf '[kvxfer]\nloopback = kvxfer_loopback\nnixl = kvxfer_nixl\n' > $D/entry_points.txt
L=/tmp/L; mkdir -p $L
T="python3 -m pytest -q -p no:cacheprovider -rfEs"
X=$(python3 -c "import xdist" 2>/dev/null && echo "-n 4")  # the NIXL file in parallel where xdist is there
timeout ${BUDGET:-540} bash -c "
  nvidia-smi --query-gpu=name,driver_version --format=csv,noheader > $L/info.txt
  python3 -c 'import torch;print(\"torch\", torch.__version__, \"cuda\", torch.cuda.is_available())' >> $L/info.txt
  LOGS=$L bash benchmarks/gpu_suite.sh digest > /dev/null 2>&1
  LOGS=$L FIXED_MEMS=VRAM FIXED_ARGS='--profile 300' bash benchmarks/gpu_suite.sh fixedcost > /dev/null 2>&1
  LOGS=$L bash benchmarks/gpu_suite.sh verified > /dev/null 2>&1
  timeout 150 $T tests/test_cuda_gpu.py tests/test_cuda_path.py tests/test_tinycopy_device.py -k 'not killed' > $L/t_path.txt 2>&1
  timeout 150 $T tests/test_cuda_security_gpu.py tests/test_cuda_identity.py tests/test_integrity_gpu.py tests/test_store_vram.py > $L/t_sec.txt 2>&1
  timeout 60 $T tests/test_cuda_gpu.py -k killed > $L/t_killed.txt 2>&1
  timeout 200 $T $X plugins/kvxfer_nixl/tests/test_nixl_backend.py > $L/t_nixl.txt 2>&1
  timeout 60 python3 benchmarks/gds_probe.py > $L/gds_probe.txt 2>&1
  LOGS=$L FIXED_MEMS=DRAM bash benchmarks/gpu_suite.sh fixedcost > /dev/null 2>&1
"
echo "overall rc $?"
tar czf ${OUT:-/tmp}/logs.tgz -C $L .
cat $L/info.txt; tail -4 $L/digest_tests.txt; tail -6 $L/digest.txt
cat $L/fixed_gpu.txt; grep -A12 "^size " $L/fixed_VRAM.txt; tail -2 $L/owner_vram.txt; tail -8 $L/verified.txt
for f in t_path t_sec t_killed t_nixl; do echo "== $f"; tail -2 $L/$f.txt; done; tail -5 $L/gds_probe.txt
