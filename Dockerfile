# The gateway image: slim Python, a non-root user, `gateway` as the entrypoint.
# Build: docker build -t gateway .   Run: docker run -p 8080:8080 gateway
# The official python images build CPython with --enable-optimizations --with-lto (PGO and
# LTO): the data plane ran at 0.80x to 0.94x the CPU per request of a build without them
# (bench/RESULTS.md: 0.80 on a busy machine, 0.94 on a quiet one).
# The data plane's hot modules are compiled with mypyc in a build stage that has a C compiler
# (gateway/native.py); the final image gets the venv, without the compiler.
#
# Base images are build arguments; the official ones are the default. Other bases (CI builds
# Debian's, .ci/docker.sh) must hold the same Python release at the same path in both stages,
# since the venv is copied between them and its modules are compiled for one release (the
# gateway logs which data plane it runs at start). PYTHON names that interpreter:
#   docker build --network host --build-arg BUILD_BASE=local/bookworm-build:ci \
#     --build-arg RUN_BASE=local/bookworm-run:ci --build-arg PYTHON=/usr/bin/python3 .
ARG BUILD_BASE=python:3.11
ARG RUN_BASE=python:3.11-slim

FROM ${BUILD_BASE} AS build
ARG PYTHON=python
# For a machine whose TLS to the package index passes a proxy: PEM certificates that pip
# trusts besides its own bundle, and another index. Used by the pip step only: this stage is
# not shipped, and nothing of them reaches the final image.
ARG BUILD_CA_CERTS=""
ARG BUILD_INDEX_URL=""
ENV PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1
WORKDIR /src
COPY pyproject.toml README.md ./
COPY gateway ./gateway
COPY controller ./controller
RUN "$PYTHON" -m venv /opt/gateway \
    && if [ -n "$BUILD_CA_CERTS" ]; then \
        bundle=$(/opt/gateway/bin/python -c "from pip._vendor import certifi; print(certifi.where())") \
        && { cat "$bundle"; printf '%s\n' "$BUILD_CA_CERTS"; } >/tmp/build-ca.pem \
        && export PIP_CERT=/tmp/build-ca.pem; \
    fi \
    && if [ -n "$BUILD_INDEX_URL" ]; then export PIP_INDEX_URL="$BUILD_INDEX_URL"; fi \
    && /opt/gateway/bin/pip install --no-compile ".[native]" \
    && /opt/gateway/bin/gateway native build \
    && /opt/gateway/bin/pip uninstall -y mypy setuptools \
    && rm -f /tmp/build-ca.pem

FROM ${RUN_BASE}
ENV PYTHONDONTWRITEBYTECODE=1 PYTHONUNBUFFERED=1 PATH=/opt/gateway/bin:$PATH
RUN useradd --create-home --uid 10001 gateway
COPY --from=build /opt/gateway /opt/gateway
# Bytecode for what the gateway's processes import, made here at the levels they run: the main
# process and the replicas at 0, a worker at 2 without column tables (`-OO -X no_debug_ranges`,
# gateway/workers/supervisor.py). The venv is installed --no-compile, a base's standard library
# has level 0 at most, and no process here writes any (PYTHONDONTWRITEBYTECODE, files the
# gateway user cannot write): each start would compile from source all it imports, and a
# worker start slower and hold more (bench/RESULTS.md, section `bytecode`). Level 2 for the
# standard library and the packages a worker imports only (tests/e2e/test_image.py: no process
# of the image compiles a module from source).
RUN stdlib=$(python -c 'import sysconfig; print(sysconfig.get_paths()["stdlib"])') \
    && site=$(python -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])') \
    && skip='/(test|tests|idlelib|tkinter|turtledemo|lib2to3|ensurepip)/' \
    && PYTHONDONTWRITEBYTECODE= python -m compileall -q -j 0 -x "$skip" "$stdlib" /opt/gateway \
    && PYTHONDONTWRITEBYTECODE= python -X no_debug_ranges -m compileall -q -j 0 -o 2 -x "$skip" \
        "$stdlib" "$site/gateway" "$site/uvloop" "$site/httptools" "$site/mypy_extensions.py"
# The venv's interpreter must exist here, and the compiled modules must be for it.
RUN gateway native status | grep -q '^compiled' || { gateway native status; exit 1; }
WORKDIR /app
COPY --chown=gateway:gateway configs ./configs

USER gateway
EXPOSE 8080 8081
# The admin listener (loopback in the demo config) answers /healthz. A config that puts it on
# all interfaces needs a token: -e GATEWAY_ADMIN_TOKEN=... (the gateway refuses otherwise).
HEALTHCHECK --interval=10s --timeout=3s --start-period=5s --retries=3 \
  CMD python -c "import urllib.request,sys; sys.exit(urllib.request.urlopen('http://127.0.0.1:8081/healthz', timeout=2).status != 200)"
ENTRYPOINT ["gateway"]
# One worker process per CPU the container may use (docs/workers.md).
CMD ["serve", "-c", "configs/gateway.yaml", "--workers", "auto"]
