#!/usr/bin/env bash
# On a lent GPU machine: set up, run the `gpu` tests and the benchmarks, write results to $OUT.
#   OUT=/some/dir bash scripts/gpu_check.sh
# Uses the machine's CUDA torch if the venv has one (setup.sh pins the CPU wheel only where there
# is no nvidia-smi). Results: $OUT/gpu_tests.txt, $OUT/bench_1b.json/.txt, $OUT/env.txt.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-gpu-results}
mkdir -p "$OUT"
bash scripts/setup.sh
{ nvidia-smi; .venv/bin/python -c "import torch; print(torch.__version__, torch.cuda.get_device_name(0))"; } > "$OUT/env.txt" 2>&1
.venv/bin/python -m pytest -q -m gpu tests/test_gpu.py > "$OUT/gpu_tests.txt" 2>&1
# llama-1b on one GPU: batch 8 x 2048, bf16, compile; fsdprun vs the plain FSDP2 loop.
.venv/bin/python scripts/bench.py llama-1b --steps 30 --repeats 1 --out "$OUT/bench_1b.json" \
  > "$OUT/bench_1b.txt" 2>&1
tail -5 "$OUT/gpu_tests.txt" "$OUT/bench_1b.txt"
