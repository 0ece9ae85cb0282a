# The gateway image: slim Python, a non-root user, `gateway` as the entrypoint.
# Build: docker build -t gateway .   Run: docker run -p 8080:8080 gateway
# The official python images build CPython with --enable-optimizations --with-lto (PGO and
# LTO): the data plane ran at 0.80x to 0.94x the CPU per request of a build without them
# (bench/RESULTS.md: 0.80 on a busy machine, 0.94 on a quiet one).
# The data plane's hot modules are compiled with mypyc in a build stage that has a C compiler
# (gateway/native.py); the final image gets the venv, without the compiler. Both stages use
# the same Python release (a module compiled for another is not used: the gateway logs which
# data plane it runs at start).
ARG PYTHON=3.11

FROM python:${PYTHON} AS build
ENV PIP_NO_CACHE_DIR=1
WORKDIR /src
COPY pyproject.toml README.md ./
COPY gateway ./gateway
COPY controller ./controller
RUN python -m venv /opt/gateway \
    && /opt/gateway/bin/pip install --no-compile . "mypy==2.4.1" "setuptools>=68" \
    && /opt/gateway/bin/gateway native build \
    && /opt/gateway/bin/pip uninstall -y mypy

FROM python:${PYTHON}-slim
ENV PYTHONDONTWRITEBYTECODE=1 PYTHONUNBUFFERED=1 PATH=/opt/gateway/bin:$PATH
RUN useradd --create-home --uid 10001 gateway
COPY --from=build /opt/gateway /opt/gateway
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
