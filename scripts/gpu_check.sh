#!/usr/bin/env bash
# On a GPU machine: run the `gpu` tests, the llama-1b benchmark (fsdprun vs the plain FSDP2 loop)
# and the plan-vs-measured memory check; write everything under $OUT.
#   OUT=/some/dir bash scripts/gpu_check.sh [all|perf|engines] [--tiny]
#
# perf: the figures of the performance work (issue 13) only, in under 8 minutes on one H200:
#   bf16 + compile vs the plain loop, float8 tensorwise vs the plain bf16 loop (3 repeats each,
#   interleaved), eager vs the plain eager loop (3 repeats), and the ablations (chunked loss,
#   selective and full activation checkpointing; 1 repeat), tokens/s and peak memory, written to
#   $OUT/perf_*.json and $OUT/perf_summary.txt. engines: the engine comparison and plan vs
#   measured. all (the default): both.
# --tiny: the same steps on the `debug` recipe with a few steps, on whatever device there is (a
#   CPU runs it end to end in a few minutes; float8 is then refused and reported as skipped).
#
# Python: $PYTHON if set, else .venv (made by scripts/setup.sh) if it holds a CUDA torch, else the
# machine's python3. On a machine without a package registry, put the wheels fsdprun needs beyond
# the machine's own packages in .whl/ (e.g. `pip download --no-deps -d .whl omegaconf==2.4.0`);
# they and fsdprun are then installed offline into that python.
# Each step has its own time limit and the script goes on past a failed step. Results:
#   $OUT/summary.txt   the figures, one block per step (also printed at the end)
#   $OUT/*.json        bench, compare and plan results
#   $OUT/results.tgz   logs and each run's metrics.jsonl (no checkpoints)
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-gpu-results}
mkdir -p "$OUT"
WORK=$(mktemp -d /tmp/fsdprun-gpu.XXXXXX)
SUMMARY="$OUT/summary.txt"
: > "$SUMMARY"
export PYTHONUNBUFFERED=1
RECIPE=${GPU_CHECK_RECIPE:-llama-1b}  # another recipe only to try the script itself
PARTS=all
TINY=0
for arg in "$@"; do
  case $arg in
    all|perf|engines) PARTS=$arg ;;
    --tiny) TINY=1 ;;
    *) echo "usage: OUT=DIR bash scripts/gpu_check.sh [all|perf|engines] [--tiny]" >&2; exit 2 ;;
  esac
done
# Steps per perf run (the first 5 untimed, as llama-1b's output.timing_warmup_steps) and repeats.
PERF_STEPS=${GPU_CHECK_PERF_STEPS:-20}
REPEATS=${GPU_CHECK_REPEATS:-3}
PERF_EXTRA=(checkpoint.save_final=false)  # a 1B model's final save is not what is measured
LIMIT_SCALE=1
if [ "$TINY" = 1 ]; then
  LIMIT_SCALE=4  # a CPU shared with others is slower than an H200 at even the tiny recipe
  RECIPE=debug
  PERF_STEPS=4
  REPEATS=1
  PERF_EXTRA+=(output.timing_warmup_steps=1 launch.nproc_per_node=1 train.micro_batch_size=4)
fi

if [ -n "${PYTHON:-}" ]; then
  PY=$PYTHON
elif [ -x .venv/bin/python ] && { [ "$TINY" = 1 ] || .venv/bin/python -c "import torch, sys; sys.exit(not torch.cuda.is_available())" 2>/dev/null; }; then
  PY=.venv/bin/python
else
  PY=$(command -v python3)
fi
if ! "$PY" -c "import fsdprun.cli, omegaconf" 2>/dev/null || [ ! -x "$(dirname "$PY")/fsdprun" ]; then
  if [ -d .whl ]; then
    "$PY" -m pip install -q --no-index --no-deps --no-build-isolation .whl/*.whl -e . \
      > "$WORK/install.txt" 2>&1 || { cat "$WORK/install.txt"; exit 1; }
  else
    "$PY" -m pip install -q -e ".[dev]" > "$WORK/install.txt" 2>&1 || { cat "$WORK/install.txt"; exit 1; }
  fi
fi
BIN=$(dirname "$PY")

step() {  # step NAME LIMIT_S CMD...: run, log to $WORK/NAME.txt, note the outcome in the summary
  local name=$1 limit=$2; shift 2
  local t0=$SECONDS
  timeout --kill-after=10 "$limit" "$@" > "$WORK/$name.txt" 2>&1
  local rc=$?
  echo "== $name: exit $rc in $((SECONDS - t0)) s" | tee -a "$SUMMARY"
  return $rc
}

{ nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.sm --format=csv
  "$PY" -c "import torch, sys; print(sys.version.split()[0], torch.__version__, torch.cuda.get_device_name(0) if torch.cuda.is_available() else 'no CUDA')"
  "$PY" -c "import torchao; print('torchao', torchao.__version__)" 2>/dev/null | tail -1
  date -u; } > "$WORK/env.txt" 2>&1
cat "$WORK/env.txt" >> "$SUMMARY"

if [ "$PARTS" = all ] || [ "$PARTS" = perf ]; then
# Performance (issue 13). Every fsdprun side runs interleaved with the plain loop in the same
# bench; ratios are medians over the repeats. Time limits add up to 7.5 minutes.
bench() {  # bench NAME LIMIT_S [bench.py args...]
  local name=$1 limit=$2; shift 2
  step "$name" $((limit * LIMIT_SCALE)) "$PY" scripts/bench.py "$RECIPE" "${PERF_EXTRA[@]}" --steps "$PERF_STEPS" \
    --out "$WORK/$name.json" "$@"
}
# bf16 + per-block compile (the recipe) vs the plain loop; float8 tensorwise vs the same plain
# bf16 loop.
bench perf_compile 240 --repeats "$REPEATS" --variant float8=precision.float8=tensorwise
# Eager: fsdprun vs the plain eager loop.
bench perf_eager 100 compile.enabled=false --repeats "$REPEATS"
# What each change buys (compiled, one repeat): the chunked loss, selective and full activation
# checkpointing, chunked + selective.
bench perf_ablations 110 --repeats 1 --variant chunked=train.loss=chunked \
  --variant selective=activation_checkpointing.mode=selective \
  --variant full_ac=activation_checkpointing.mode=full \
  --variant chunked_selective=train.loss=chunked,activation_checkpointing.mode=selective
step perf_gpu_tests 60 "$PY" -m pytest -q -m gpu tests/test_prefetch.py
tail -3 "$WORK/perf_gpu_tests.txt" >> "$SUMMARY"
"$PY" scripts/perf_summary.py "$WORK" > "$WORK/perf_summary.txt" 2>&1
cat "$WORK/perf_summary.txt" >> "$SUMMARY"
fi

if [ "$PARTS" = all ] || [ "$PARTS" = engines ]; then
# llama-1b on one GPU (batch 8 x 2048, bf16, per-block compile): fsdprun vs the plain loop.
step bench_1b 330 "$PY" scripts/bench.py "$RECIPE" --steps 30 --repeats 1 --out "$WORK/bench_1b.json"
tail -14 "$WORK/bench_1b.txt" >> "$SUMMARY"
"$PY" - "$WORK/bench_1b.json" >> "$SUMMARY" 2>&1 <<'EOF'
import json, sys
r = json.load(open(sys.argv[1]))
f = r["best"]["fsdprun"]
t = f["throughput"]
print(f"fsdprun/plain tokens/s {r['tokens_per_s_ratio']:.3f}  memory {r['memory_ratio']:.3f}  "
      f"MFU {t['mfu']}  TFLOP/s/device {t['tflops_per_device']:.1f}  "
      f"peak allocated {f['ranks'][0]['peak_allocated_bytes']}")
EOF

# The engines on one GPU (eager: no compile time): fsdp2, fsdp1, ddp side by side, then plan vs
# measured peak for each (plan strategy `full` for the FSDP engines, `ddp` for ddp).
step compare_1b 200 "$BIN/fsdprun" compare "$RECIPE" --configs fsdp2,fsdp1,ddp --steps 12 \
  schedule.warmup_steps=2 compile.enabled=false output.timing_warmup_steps=3 \
  checkpoint.save_final=false \
  --run-dir "$WORK/compare_1b" --json
cp "$WORK/compare_1b.txt" "$WORK/compare_1b.json"
step plan_1b 30 "$BIN/fsdprun" plan "$RECIPE" --json
cp "$WORK/plan_1b.txt" "$WORK/plan_1b.json"
"$PY" scripts/plan_vs_measured.py "$WORK/compare_1b" --bench "$WORK/bench_1b.json" --recipe "$RECIPE" >> "$SUMMARY" 2>&1
"$PY" -c "import json,sys; from fsdprun.tools.compare import markdown; t=open(sys.argv[1]).read(); print(markdown(json.loads(t[t.index(chr(123)):])))" "$WORK/compare_1b.json" >> "$SUMMARY" 2>&1

step gpu_tests 150 "$PY" -m pytest -q -m gpu tests/test_gpu.py
tail -3 "$WORK/gpu_tests.txt" >> "$SUMMARY"
fi

# Small files only: run directories may hold multi-GB checkpoints.
cp "$WORK"/*.json "$WORK"/perf_summary.txt "$OUT"/ 2>/dev/null
tar czf "$OUT/results.tgz" --exclude=checkpoints -C "$WORK" . 2>/dev/null
cat "$SUMMARY"
