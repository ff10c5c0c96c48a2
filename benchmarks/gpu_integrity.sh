#!/usr/bin/env bash
# The GPU run behind BENCHMARKS.md's "Integrity" section and RELIABILITY.md's corruption rows:
# one H200, this checkout, the cp312 wheels (nixl, nixl-cu13, xxhash) carried in .whl/.
#   bash benchmarks/gpu_integrity.sh      # logs and JSON under $OUT
set -u
LOGS=${OUT:-/tmp}
export PYTHONUNBUFFERED=1
python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl 2>&1 | tail -2
export PYTHONPATH=/tmp/site:$PWD:$PWD/plugins
D=/tmp/site/kvxfer-0.1.0.dist-info; mkdir -p $D
printf 'Metadata-Version: 2.1\nName: kvxfer\nVersion: 0.1.0\nRequires-Dist: nixl>=1.5; extra == "nixl"\n' > $D/METADATA
printf '[kvxfer]\nloopback = kvxfer_loopback\nnixl = kvxfer_nixl\n' > $D/entry_points.txt
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv | tee $LOGS/info.txt
python3 -c "import torch, numpy; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'numpy', numpy.__version__)" | tee -a $LOGS/info.txt
B="python3 benchmarks/bench_integrity.py"
timeout 150 $B --memory VRAM --blocks 512 --request 256 --layers 32 --page 65536 --iters 9 \
  --json $LOGS/vram.json 2>&1 | tee $LOGS/bench.txt
timeout 60 $B --memory DRAM --blocks 256 --request 128 --layers 32 --page 32768 --iters 7 --threads 1 \
  --json $LOGS/dram_t1.json 2>&1 | tee -a $LOGS/bench.txt
timeout 60 $B --memory DRAM --blocks 256 --request 128 --layers 32 --page 32768 --iters 7 --threads 8 \
  --json $LOGS/dram_t8.json 2>&1 | tee -a $LOGS/bench.txt
timeout 200 python3 -m pytest -q -p no:cacheprovider -rfE --durations=10 tests/test_integrity_gpu.py \
  tests/test_integrity.py 2>&1 | tee $LOGS/tests.txt
