# syntax=docker/dockerfile:1
#
# One image for every rolegate component; the subcommand picks the role:
#   rolegate operator --namespace rolegate
#   rolegate proxy --configmap rolegate/rolegate-config --host 0.0.0.0
# Why one image, and how to build, pin and run it: docs/container.md.
#
# Both stages use the same base: the virtual environment's `python` is a symlink to the
# base image's interpreter. Pin it by digest for a release build:
#   docker build --build-arg PYTHON_IMAGE=python:3.11-slim@sha256:<digest> -t rolegate .
ARG PYTHON_IMAGE=python:3.11-slim

# ---- builder: a virtual environment at /opt/rolegate, copied whole into the final stage
FROM ${PYTHON_IMAGE} AS builder

ENV PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PIP_NO_CACHE_DIR=1 \
    PYTHONDONTWRITEBYTECODE=1

RUN python -m venv /opt/rolegate

# Only what the build reads: the project metadata, the readme it names, the packages.
WORKDIR /src
COPY pyproject.toml README.md constraints.txt ./
COPY policy/ policy/
COPY proxy/ proxy/
COPY sim/ sim/
COPY operator/ operator/
COPY cli/ cli/

# Every dependency ships a wheel for this platform: no compiler is needed, even here.
# The installer leaves the environment once the install is done, every component is
# imported once as a smoke test, and all modules are byte-compiled now so that nothing
# has to be written at run time. unchecked-hash .pyc files stay valid whatever the copy
# does to the sources' timestamps.
# The tracing extra is in: traces stay off until the pod's OTEL_* environment asks for them
# (docs/tracing.md).
RUN /opt/rolegate/bin/pip install --no-cache-dir -c constraints.txt '.[tracing]' \
 && /opt/rolegate/bin/pip uninstall --yes setuptools wheel pip \
 && /opt/rolegate/bin/python -c "import rolegate_cli.main, rolegate_operator.main, rolegate_proxy.edge.server, rolegate_proxy.edge.span_export, rolegate_sim.server" \
 && /opt/rolegate/bin/python -m compileall -q -f --invalidation-mode unchecked-hash /opt/rolegate/lib \
 && /opt/rolegate/bin/rolegate --help > /dev/null

# ---- final: the base interpreter, the environment, a non-root user; nothing to build with
FROM ${PYTHON_IMAGE}

# Set at build time: --build-arg SOURCE_URL=https://… --build-arg REVISION=$(git rev-parse HEAD)
ARG SOURCE_URL=""
ARG REVISION=""
LABEL org.opencontainers.image.title="rolegate" \
      org.opencontainers.image.description="A Kubernetes-native routing proxy for LLM traffic: one image, the subcommand (operator, proxy, compile, sim) picks the role." \
      org.opencontainers.image.licenses="Apache-2.0" \
      org.opencontainers.image.version="0.1.0" \
      org.opencontainers.image.source="${SOURCE_URL}" \
      org.opencontainers.image.revision="${REVISION}"

# The base image's installer goes (the image never installs anything at run time); its
# standard library ships without .pyc files, so it is byte-compiled here, once. The user
# is numeric in USER below, so `runAsNonRoot` can be verified; the entry in /etc/passwd
# only gives the uid a name.
RUN python -m pip uninstall --yes --no-cache-dir setuptools wheel pip \
 && python -m compileall -q /usr/local/lib/python3.11 \
 && groupadd --system --gid 10001 rolegate \
 && useradd --system --uid 10001 --gid 10001 --no-create-home --no-log-init \
        --home-dir /nonexistent --shell /usr/sbin/nologin rolegate

COPY --from=builder /opt/rolegate /opt/rolegate

ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PATH=/opt/rolegate/bin:$PATH

USER 10001:10001
# The proxy's port (`rolegate proxy --port`, default 8080); bind it with --host 0.0.0.0.
EXPOSE 8080
ENTRYPOINT ["rolegate"]
CMD ["--help"]
