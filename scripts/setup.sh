#!/usr/bin/env bash
# Create (or reuse) .venv and install fsdprun with its dev tools and the extras its tests use: hf
# (transformers, for the HuggingFace-model tests; ~15 s more), tensorboard, wandb and plot
# (matplotlib; the three together ~10 s, no other torch). Idempotent and quick when nothing changed.
# Without an NVIDIA driver the CPU build of torch 2.13.0 is pinned; with one, pip keeps a torch
# already in the venv or picks a CUDA build in the supported range.
set -euo pipefail
cd "$(dirname "$0")/.."
python=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$python" -m venv .venv
stamp=.venv/.fsdprun-setup
want=$(cat pyproject.toml scripts/constraints-cpu.txt | sha256sum | cut -c1-16)
if [ "$(cat "$stamp" 2>/dev/null)" != "$want" ]; then
  constraints=()
  command -v nvidia-smi >/dev/null 2>&1 || constraints=(-c scripts/constraints-cpu.txt)
  .venv/bin/python -m pip install -q --upgrade pip
  .venv/bin/python -m pip install -q "${constraints[@]}" -e ".[dev,hf,tensorboard,wandb,plot]"
  echo "$want" > "$stamp"
fi
