#!/usr/bin/env bash
# Install fsdprun from this checkout as a wheel, with the extras a cluster run needs. The one
# install step of the image (Dockerfile: its two layers), of examples/skypilot/train.yaml's setup,
# and of any node without the image. CI runs it on a copy of what the Dockerfile copies
# (tests/test_image.py).
#
#   bash docker/install.sh            # both steps, in this order:
#   bash docker/install.sh deps       # what pyproject.toml requires (+ EXTRAS), not fsdprun itself
#   bash docker/install.sh fsdprun    # the wheel of this checkout, without its dependencies
#
# deps reads pyproject.toml alone (the Dockerfile copies nothing else before it, so a change to
# the code rebuilds only the fsdprun layer); a torch already installed in pyproject's range (the
# base image's CUDA build) is kept.
#
# Environment: PYTHON (default python3), EXTRAS (default hf,float8,tensorboard; "" for none),
# FSDPRUN_WHEEL_DIR (where the wheel goes; default a temporary folder), FSDPRUN_TARGET (install
# fsdprun into this folder, pip's --target, instead of the environment), and pip's own variables
# (PIP_INDEX_URL, PIP_EXTRA_INDEX_URL, PIP_NO_INDEX, ...).
set -euo pipefail
cd "$(dirname "$0")/.."
python=${PYTHON:-python3}
extras=${EXTRAS-hf,float8,tensorboard}
step=${1:-all}

deps() {
  local reqs
  reqs=$(mktemp)
  # The build backend (the fsdprun step builds without isolation: no index needed there), the
  # dependencies and those of each extra asked for.
  "$python" - "$extras" >"$reqs" <<'PY'
import sys

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10: the parser pip itself carries
    from pip._vendor import tomli as tomllib

with open("pyproject.toml", "rb") as f:
    doc = tomllib.load(f)
project = doc["project"]
wanted = [e for e in sys.argv[1].split(",") if e]
unknown = sorted(set(wanted) - set(project["optional-dependencies"]))
if unknown:
    sys.exit(f"install.sh: EXTRAS names {unknown}, not extras of pyproject.toml")
reqs = [*doc["build-system"]["requires"], *project["dependencies"]]
for extra in wanted:
    reqs += project["optional-dependencies"][extra]
print("\n".join(reqs))
PY
  "$python" -m pip install --no-cache-dir -r "$reqs"
  rm -f "$reqs"
}

package() {
  local dist=${FSDPRUN_WHEEL_DIR:-} made=
  if [ -z "$dist" ]; then
    dist=$(mktemp -d) made=1
  fi
  "$python" -m pip wheel --no-deps --no-build-isolation --no-cache-dir -q -w "$dist" .
  local wheel
  wheel=$(ls "$dist"/fsdprun-*.whl)
  local into=()
  [ -n "${FSDPRUN_TARGET:-}" ] && into=(--target "$FSDPRUN_TARGET")
  "$python" -m pip install --no-deps --no-index --no-cache-dir -q "${into[@]}" "$wheel"
  [ -n "$made" ] && rm -rf "$dist"
  # The command works: its entry point, the package and its recipes.
  if [ -n "${FSDPRUN_TARGET:-}" ]; then
    PYTHONPATH="$FSDPRUN_TARGET${PYTHONPATH:+:$PYTHONPATH}" "$FSDPRUN_TARGET/bin/fsdprun" --version
  else
    "$(dirname "$("$python" -c 'import sys; print(sys.executable)')")/fsdprun" --version
  fi
}

case "$step" in
  deps) deps ;;
  fsdprun) package ;;
  all) deps && package ;;
  *) echo "usage: bash docker/install.sh [deps|fsdprun]" >&2; exit 2 ;;
esac
