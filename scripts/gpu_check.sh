#!/usr/bin/env bash
# On a GPU machine: the `gpu` tests, the performance figures (fsdprun vs the plain FSDP2 loop),
# the engines and plan vs measured, and `fsdprun tune` on llama-1b; everything under $OUT.
#   OUT=/some/dir [GPU_CHECK_BUDGET=S] bash scripts/gpu_check.sh [PART,PART,...] [--tiny]
#
# Parts, run in this order (default: perf,profile,tests; the figures first, so that a time
# budget cuts the tests, not them):
#   perf       like with like, one bench, interleaved repeats (GPU_CHECK_REPEATS, default 3):
#              bf16 + per-block compile vs the plain loop, float8 tensorwise + compile vs the
#              plain float8 loop (torchao's defaults), eager vs the plain eager loop, and once
#              the minimal plain loop (scripts/plain_minimal.py) as a check of the plain one;
#              and float8 with float8 all-gather forced on at one rank (what auto saves);
#              tokens/s and peak memory in $OUT/perf.json.
#   profile    where a step's time goes: llama-1b as benchmarked (bf16 + compile, and float8),
#              2 steps traced after 8, summarized by scripts/trace_summary.py (GPU busy, time
#              by kernel kind, host syncs, idle gaps); the traces stay on the machine.
#   tests      every `gpu` test: CUDA training, resume, CPU offload (cpu:gloo,cuda:nccl), the
#              memory snapshot, FlexAttention block masks for packed rows (model and a chat
#              fine-tuning run against the dense-mask path on CPU), and non-logging steps under
#              torch.cuda.set_sync_debug_mode("error") (pretraining and packed chat rows), a
#              non-finite step skipped on the device, and CPU ranks on the GPU machine.
#   ablations  what each change buys, compiled, one repeat: the chunked loss and selective
#              activation checkpointing (GPU_CHECK_FULL_ABLATIONS=1: also full checkpointing,
#              and chunked + selective).
#   engines    llama-1b fsdprun vs plain (30 steps), fsdp2/fsdp1/ddp side by side, plan vs
#              measured.
#   tune       scripts/bench_tune.py on llama-1b (eager, 1 x 8 accumulation): tune within 90 s,
#              then the tuned layer against its start, interleaved.
# GPU_CHECK_BUDGET: seconds for the whole script (0, the default: no limit). A step gets what is
# left when it would run longer; one with under 30 s left is skipped, and the summary says so.
# --tiny: the same steps on the `debug` recipe with a few steps, on whatever device there is (a
#   CPU runs it end to end in a few minutes; float8 runs there through the test-only switch).
#
# Python: $PYTHON if set, else .venv (made by scripts/setup.sh) if it holds a CUDA torch, else the
# machine's python3. On a machine without a package registry, put the wheels fsdprun needs beyond
# the machine's own packages in .whl/ (e.g. `pip download --no-deps -d .whl omegaconf==2.4.0`);
# they and fsdprun are then installed offline into that python.
# Each step has its own time limit and the script goes on past a failed step. Results (at most 8
# files, as a lent machine sends back):
#   $OUT/summary.txt   the figures, one block per step (also printed at the end)
#   $OUT/perf_*.json   the performance runs; perf_summary.txt their one-line-a-side summary
#   $OUT/results.tgz   every log, the other JSON results and each run's metrics.jsonl (no
#                      checkpoints)
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-gpu-results}
mkdir -p "$OUT"
WORK=$(mktemp -d /tmp/fsdprun-gpu.XXXXXX)
SUMMARY="$OUT/summary.txt"
: > "$SUMMARY"
export PYTHONUNBUFFERED=1
RECIPE=${GPU_CHECK_RECIPE:-llama-1b}  # another recipe only to try the script itself
PARTS=perf,profile,tests
TINY=0
usage="usage: OUT=DIR bash scripts/gpu_check.sh [tests,perf,profile,ablations,engines,tune] [--tiny]"
for arg in "$@"; do
  case $arg in
    --tiny) TINY=1 ;;
    all) PARTS=tests,perf,profile,ablations,engines,tune ;;
    [a-z]*)
      for part in ${arg//,/ }; do
        case $part in tests|perf|profile|ablations|engines|tune) ;; *) echo "$usage" >&2; exit 2 ;; esac
      done
      PARTS=$arg ;;
    *) echo "$usage" >&2; exit 2 ;;
  esac
done
has() { [[ ",$PARTS," == *",$1,"* ]]; }
BUDGET=${GPU_CHECK_BUDGET:-0}
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
  PERF_EXTRA+=(output.timing_warmup_steps=1 launch.nproc_per_node=1 train.micro_batch_size=8)
  export FSDPRUN_TEST_FLOAT8_ON_CPU=1  # test-only: float8 runs (slowly) on CPU ranks
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
  if [ "$BUDGET" -gt 0 ]; then
    local left=$((BUDGET - SECONDS))
    if [ "$left" -lt 30 ]; then
      echo "== $name: skipped, $left s of GPU_CHECK_BUDGET=$BUDGET left" | tee -a "$SUMMARY"
      return 124
    fi
    [ "$left" -lt "$limit" ] && limit=$left
  fi
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


# Performance. Every fsdprun side runs interleaved with the plain loop in the same bench;
# ratios are medians over the repeats.
bench() {  # bench NAME LIMIT_S [bench.py args...]
  local name=$1 limit=$2; shift 2
  step "$name" $((limit * LIMIT_SCALE)) "$PY" scripts/bench.py "$RECIPE" "${PERF_EXTRA[@]}" --steps "$PERF_STEPS" \
    --out "$WORK/$name.json" "$@"
}
if has perf; then
# Like with like (scripts/bench.py pairs each side with the plain loop of its precision and
# features): bf16 + per-block compile (the recipe), float8 tensorwise, eager; the minimal loop once.
# float8_gather forces float8 all-gather at one rank, where auto leaves it off: what it costs.
bench perf 380 --repeats "$REPEATS" --minimal --variant float8=precision.float8=tensorwise \
  --variant float8_gather=precision.float8=tensorwise,precision.float8_all_gather=true \
  --variant eager=compile.enabled=false
fi
if has profile; then
for variant in bf16 float8; do
  extra=()
  [ "$variant" = float8 ] && extra=(precision.float8=tensorwise)
  step "profile_$variant" 80 "$BIN/fsdprun" train "$RECIPE" "${PERF_EXTRA[@]}" "${extra[@]}" \
    train.steps=12 profile.enabled=true profile.wait=8 profile.warmup=1 profile.active=2 \
    --run-dir "$WORK/profile_$variant"
  trace="$WORK/profile_$variant/profile/rank-0.pt.trace.json"
  if [ -f "$trace" ]; then
    "$PY" scripts/trace_summary.py "$trace" > "$WORK/profile_$variant.summary.txt" 2>&1
    { echo "-- where a $variant step's time goes:"; head -40 "$WORK/profile_$variant.summary.txt"; } >> "$SUMMARY"
  else
    tail -2 "$WORK/profile_$variant.txt" >> "$SUMMARY"
  fi
done
fi
if has tests; then
# Every `gpu` test, spread over 4 workers (the GPU holds them all at once).
step gpu_tests 130 "$PY" -m pytest -q -m gpu -n 4 --dist load -p no:cacheprovider tests
tail -4 "$WORK/gpu_tests.txt" >> "$SUMMARY"
fi
if has ablations; then
# What each change buys (compiled, one repeat): the chunked loss and selective activation
# checkpointing (GPU_CHECK_FULL_ABLATIONS=1: also full checkpointing, and chunked + selective).
more=()
[ "${GPU_CHECK_FULL_ABLATIONS:-0}" = 1 ] && more=(--variant full_ac=activation_checkpointing.mode=full
  --variant chunked_selective=train.loss=chunked,activation_checkpointing.mode=selective)
bench perf_ablations 110 --repeats 1 --variant chunked=train.loss=chunked \
  --variant selective=activation_checkpointing.mode=selective "${more[@]}"
fi
if has perf || has ablations; then
"$PY" scripts/perf_summary.py "$WORK" > "$WORK/perf_summary.txt" 2>&1
cat "$WORK/perf_summary.txt" >> "$SUMMARY"
fi

if has engines; then
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
fi

if has tune; then
# fsdprun tune on a starting recipe an engineer might write first, then its tuned layer against
# that start, interleaved (scripts/bench_tune.py; --tiny: the debug model on the CPU).
if [ "$TINY" = 1 ]; then
  step tune 240 "$PY" scripts/bench_tune.py --nproc-per-node 1 --budget 60s --steps 6 --repeats 1 \
    --work "$WORK/tune_work"
else
  step tune 200 "$PY" scripts/bench_tune.py --gpu --cases llama-1b --work "$WORK/tune_work"
fi
grep -E "^ *(tune|winner|tuned|start|== )" "$WORK/tune.txt" | tail -8 >> "$SUMMARY"
fi

# Small files only (run directories may hold multi-GB checkpoints), at most 8 of them.
cp "$WORK"/perf*.json "$WORK"/perf_summary.txt "$OUT"/ 2>/dev/null
tar czf "$OUT/results.tgz" --exclude=checkpoints --exclude='*.distcp' --exclude='*.pt.trace.json' \
  --exclude='*.pickle' -C "$WORK" . 2>/dev/null
cat "$SUMMARY"
