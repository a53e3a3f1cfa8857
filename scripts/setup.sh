#!/usr/bin/env bash
# Create (or reuse) .venv and install fsdprun with its dev tools and the extras its tests use: hf
# (transformers, for the HuggingFace-model tests; ~15 s more), datasets (local HF datasets),
# tensorboard, wandb and plot (matplotlib; the three together ~10 s, no other torch), float8
# (torchao: the float8 tests run its training on CPU). Idempotent
# and quick when nothing changed.
#
# Which torch: without an NVIDIA driver the version is pinned to 2.13.0
# (scripts/constraints-cpu.txt); with one, pip keeps a torch already in the venv or picks one in
# the supported range. The *build* comes from pip's index: on Linux, PyPI serves only CUDA builds
# (torch plus ~15 nvidia-* wheels, several GB), even on a machine without a GPU. For the CPU
# build, give PyTorch's CPU index; torch (and its dependencies) then come from there:
#   FSDPRUN_TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu bash scripts/setup.sh
set -euo pipefail
cd "$(dirname "$0")/.."
python=${PYTHON:-python3}
index=${FSDPRUN_TORCH_INDEX_URL:-}
[ -x .venv/bin/python ] || "$python" -m venv .venv
stamp=.venv/.fsdprun-setup
want=$( (cat pyproject.toml scripts/constraints-cpu.txt scripts/setup.sh; echo "$index") |
  sha256sum | cut -c1-16)
if [ "$(cat "$stamp" 2>/dev/null)" != "$want" ]; then
  constraints=()
  command -v nvidia-smi >/dev/null 2>&1 || constraints=(-c scripts/constraints-cpu.txt)
  .venv/bin/python -m pip install -q --upgrade pip
  if [ -n "$index" ]; then
    # torch first, from that index alone; the install below keeps it (it satisfies the range).
    torch_req=$(grep -o '"torch[<>=!~][^"]*"' pyproject.toml | head -1 | tr -d '"')
    .venv/bin/python -m pip install -q --no-compile "${constraints[@]}" --index-url "$index" \
      "$torch_req"
  else
    echo "setup: torch comes from pip's configured index (set FSDPRUN_TORCH_INDEX_URL to choose" \
      "one, e.g. https://download.pytorch.org/whl/cpu for the CPU build)" >&2
  fi
  .venv/bin/python -m pip install -q --no-compile "${constraints[@]}" \
    -e ".[dev,hf,datasets,tensorboard,wandb,plot,float8]"
  # pip byte-compiles every file it installs, one at a time, transformers' hundreds of other
  # models and the packages' own tests included; compileall does it on every core, without
  # those (a file left out compiles when it is first imported). Setup on 2 cores, fresh venvs,
  # interleaved: 88 -> 67 s and 130 -> 96 s (2026-12-03).
  site=$(.venv/bin/python -c "import sysconfig; print(sysconfig.get_paths()['purelib'])")
  .venv/bin/python -m compileall -qq -j 0 \
    -x '/tests?/|/testing/_internal/(?!distributed/)|/transformers/models/(?!llama/|auto/)' \
    "$site" || echo "setup: some installed files did not byte-compile (they compile at import)" >&2
  echo "$want" > "$stamp"
fi
