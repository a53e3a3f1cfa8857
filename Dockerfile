# fsdprun's image: PyTorch's official CUDA runtime image (its torch in pyproject.toml's range)
# with fsdprun installed from this checkout as a wheel, with the hf, float8 and tensorboard
# extras. `fsdprun` is the entrypoint; it runs as uid 1000, not root.
#
#   docker build -t REGISTRY/fsdprun:0.1.0 .
#   docker push REGISTRY/fsdprun:0.1.0
#   docker run --rm REGISTRY/fsdprun:0.1.0 train debug   # the demo, 2 CPU ranks: any machine
#
# The install is docker/install.sh, in two steps: the dependencies, from pyproject.toml alone,
# then fsdprun's wheel, so a change to the code rebuilds the last layers only. CI runs the same
# script on a copy of what this file copies (tests/test_image.py); the image itself is built
# where a container engine runs. BASE_IMAGE may name another image with Python >= 3.10 (a torch
# outside the range is replaced from pip's index); EXTRAS other extras (docs/development.md).
ARG BASE_IMAGE=pytorch/pytorch:2.13.0-cuda13.0-cudnn9-runtime
FROM ${BASE_IMAGE}

ARG EXTRAS=hf,float8,tensorboard
ENV PYTHONUNBUFFERED=1 PIP_DISABLE_PIP_VERSION_CHECK=1 PIP_ROOT_USER_ACTION=ignore

# Owns its home, where runs/ and the caches go unless a volume says otherwise (HF_HOME, ...).
RUN useradd --create-home --uid 1000 --user-group --shell /bin/bash fsdprun

WORKDIR /opt/fsdprun
COPY pyproject.toml ./
COPY docker/install.sh docker/
RUN EXTRAS="$EXTRAS" bash docker/install.sh deps

COPY README.md ./
COPY recipes recipes
COPY fsdprun fsdprun
RUN bash docker/install.sh fsdprun && rm -rf /opt/fsdprun

USER 1000:1000
WORKDIR /home/fsdprun
ENTRYPOINT ["fsdprun"]
CMD ["--help"]
