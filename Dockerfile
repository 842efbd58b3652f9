# syntax=docker/dockerfile:1
# One image for every astro role (engine, predictor, tagger, scheduler, epp, bench):
#   docker build -t astro:0.1.0 .                                          # sim / CPU image (+ the epp extra)
#   docker build -t astro:0.1.0-vllm --build-arg ASTRO_EXTRAS=vllm,epp .   # + vLLM 0.32 (CUDA wheels from PyPI)
# Run a role: docker run --rm -p 9000:9000 astro:0.1.0 serve scheduler --help
# Kubernetes manifests that use it: deploy/kubernetes/ (docs/deploy-kubernetes.md).
#
# The package is installed editable from /opt/astro: the shipped execution profiles, length
# models and RPS classifiers are read from `<repo>/artifacts` next to `src/`
# (rps_astro_cli/data_paths.py), so the image keeps that layout (a plain wheel install
# would not carry them). The look-ahead engine (sim/lookahead_engine/) is compiled with mypyc
# at build time.
# Runs as the unprivileged user astro (uid/gid 10001); nothing under /opt is writable by it.

ARG PYTHON_IMAGE=python:3.11-slim-bookworm

FROM ${PYTHON_IMAGE} AS build
# a C compiler for mypyc (the compiled look-ahead engine is 3-5x faster than its source);
# not version-pinned: the base image's Debian release pins them, and Debian drops superseded
# point versions from its archive, which would break a pinned build
# hadolint ignore=DL3008
RUN apt-get update \
 && apt-get install -y --no-install-recommends gcc libc6-dev \
 && rm -rf /var/lib/apt/lists/*
# the epp extra (gRPC + Envoy's protobufs, ~15 MB) by default: `astro serve epp` is a role too
ARG ASTRO_EXTRAS="epp"
# ASTRO_REQUIRE_BUILD=1: a look-ahead engine that does not compile fails the build (setup.py)
ENV PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1 ASTRO_REQUIRE_BUILD=1
WORKDIR /opt/astro
COPY pyproject.toml setup.py README.md ./
COPY src ./src
COPY artifacts ./artifacts
COPY recipes ./recipes
RUN python -m venv /opt/venv \
 && /opt/venv/bin/pip install -e "/opt/astro${ASTRO_EXTRAS:+[$ASTRO_EXTRAS]}" \
 && /opt/venv/bin/python -m compileall -q /opt/astro/src \
 && /opt/venv/bin/astro --help > /dev/null

FROM ${PYTHON_IMAGE}
LABEL org.opencontainers.image.title="astro" \
      org.opencontainers.image.description="astro (rps_astro_cli): Astrolabe dispatch + RPS-Serve, every role in one image" \
      org.opencontainers.image.licenses="Apache-2.0"
RUN groupadd --gid 10001 astro \
 && useradd --uid 10001 --gid 10001 --home-dir /home/astro --create-home --shell /usr/sbin/nologin astro
COPY --from=build /opt/venv /opt/venv
COPY --from=build /opt/astro /opt/astro
ENV PATH=/opt/venv/bin:$PATH \
    PYTHONUNBUFFERED=1 \
    PYTHONDONTWRITEBYTECODE=1 \
    HOME=/home/astro
WORKDIR /home/astro
USER 10001:10001
# engine 8000, predictor 8100, tagger 8200, scheduler 9000 (the ports deploy/kubernetes uses)
EXPOSE 8000 8100 8200 9000
ENTRYPOINT ["astro"]
CMD ["--help"]
