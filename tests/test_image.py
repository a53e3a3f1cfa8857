"""The image: the Dockerfile's base and the files it copies, and its install script run as CI
can run it (no container engine here).

The Dockerfile installs fsdprun with docker/install.sh in two steps (the dependencies, from
pyproject.toml alone; then fsdprun's wheel). The test lays out exactly what the Dockerfile copies
in a folder of its own, as the build context would hold it, and runs the script there with this
environment's Python: its `deps` step against this environment, which already holds every
dependency (pip's index is off: it can install nothing, only find everything there); its
`fsdprun` step into a folder of its own (pip's --target), whose `fsdprun train debug` then
trains with the installed package and its recipes, not this checkout's.

Run with `pytest tests/test_image.py`.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from packaging.specifiers import SpecifierSet
from packaging.version import Version

ROOT = Path(__file__).resolve().parents[1]
DOCKERFILE = (ROOT / "Dockerfile").read_text()


def _instructions(name: str) -> list[list[str]]:
    """The arguments of each `NAME ...` instruction of the Dockerfile."""
    return [line.split()[1:] for line in DOCKERFILE.splitlines() if line.startswith(f"{name} ")]


def _copied() -> list[tuple[str, str]]:
    """(source, destination) of every file or folder the Dockerfile copies into the image,
    destinations relative to the build's working folder."""
    pairs = []
    for args in _instructions("COPY"):
        *sources, dest = args
        for source in sources:
            target = dest.rstrip("/") + "/" + Path(source).name if dest.endswith("/") else dest
            pairs.append((source, os.path.normpath(target)))
    return pairs


def test_dockerfile_base_has_a_torch_in_range_and_copies_only_what_exists():
    tomllib = pytest.importorskip("tomllib")  # Python 3.11+
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    [torch_req] = [r for r in project["dependencies"] if re.match(r"torch\W", r)]
    supported = SpecifierSet(torch_req.removeprefix("torch"))
    [[base]] = [a for a in _instructions("ARG") if a[0].startswith("BASE_IMAGE=")]
    image, _, tag = base.removeprefix("BASE_IMAGE=").partition(":")
    assert image == "pytorch/pytorch" and "cuda" in tag, base  # PyTorch's official CUDA image
    assert Version(tag.split("-")[0]) in supported, (tag, torch_req)
    assert _instructions("FROM") == [["${BASE_IMAGE}"]]
    for source, _ in _copied():
        assert (ROOT / source).exists(), source
    # Dependencies before the source: the code's layers come after the install of the rest.
    lines = DOCKERFILE.splitlines()
    deps = next(i for i, line in enumerate(lines) if "install.sh deps" in line)
    code = next(i for i, line in enumerate(lines) if line.startswith("COPY fsdprun"))
    assert all("pyproject.toml" in lines[i] or "docker/" in lines[i]
               for i in range(deps) if lines[i].startswith("COPY"))  # fmt: skip
    assert deps < code
    [extras] = [a[0] for a in _instructions("ARG") if a[0].startswith("EXTRAS=")]
    assert set(extras.removeprefix("EXTRAS=").split(",")) == {"hf", "float8", "tensorboard"}
    assert set(extras.removeprefix("EXTRAS=").split(",")) <= set(project["optional-dependencies"])
    assert _instructions("USER") == [["1000:1000"]]  # not root
    assert _instructions("ENTRYPOINT") == [['["fsdprun"]']]


def test_the_images_install_script_gives_a_working_fsdprun(tmp_path):
    context = tmp_path / "context"  # what the Dockerfile copies, where it copies it
    for source, dest in _copied():
        target = context / dest
        target.parent.mkdir(parents=True, exist_ok=True)
        if (ROOT / source).is_dir():
            shutil.copytree(ROOT / source, target, ignore=shutil.ignore_patterns("__pycache__"))
        else:
            shutil.copy2(ROOT / source, target)
    site = tmp_path / "site"
    env = {**os.environ, "PYTHON": sys.executable, "PIP_NO_INDEX": "1",
           "FSDPRUN_TARGET": str(site), "PIP_DISABLE_PIP_VERSION_CHECK": "1"}  # fmt: skip
    for step in ("deps", "fsdprun"):
        done = subprocess.run(["bash", str(context / "docker/install.sh"), step], env=env,
                              capture_output=True, text=True, timeout=300)  # fmt: skip
        assert done.returncode == 0, (step, done.stdout[-2000:], done.stderr[-2000:])
    assert done.stdout.strip().startswith("fsdprun ")  # its `fsdprun --version`
    assert {p.name for p in site.iterdir()} >= {"bin", "fsdprun"}
    # The installed command, its package first on the path: the checkout's is not used.
    run_env = {**env, "PYTHONPATH": str(site), "OMP_NUM_THREADS": "1"}
    where = subprocess.run([sys.executable, "-c", "import fsdprun; print(fsdprun.__file__)"],
                           env=run_env, capture_output=True, text=True, cwd=tmp_path)  # fmt: skip
    assert where.stdout.startswith(str(site)), where
    trained = subprocess.run(
        [str(site / "bin" / "fsdprun"), "train", "debug", "train.steps=2", "--run-dir",
         str(tmp_path / "run")],
        env=run_env, capture_output=True, text=True, cwd=tmp_path, timeout=300,
    )  # fmt: skip
    assert trained.returncode == 0, trained.stderr[-3000:]
    assert "final loss" in trained.stdout
