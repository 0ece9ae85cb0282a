# Sourced by .ci/run: a Docker Engine, the local test image for the docker backend's tests and the
# local bases the Dockerfile is built from (tests/e2e/test_image.py).
# Exports GATEWAY_TEST_DOCKER_HOST, GATEWAY_TEST_IMAGE, GATEWAY_TEST_BUILD_BASE,
# GATEWAY_TEST_RUN_BASE and GATEWAY_TEST_BUILD_CA_CERTS; registers its cleanup with on_exit.
# Docker Engine and debootstrap (Debian packages "docker.io" and "debootstrap"), if missing;
# and what the second engine's tests use: "iproute2" (its bridge), "openssh-server" and
# "openssh-client" (an ssh:// engine through a real sshd on loopback).
has() { command -v "$1" >/dev/null || [ -x "/usr/sbin/$1" ]; } # sshd is in sbin
if ! has docker || ! has dockerd || ! has debootstrap || ! has ip || ! has sshd || ! has ssh; then
    $sudo apt-get update -qq
    $sudo env DEBIAN_FRONTEND=noninteractive \
        apt-get install -y -qq --no-install-recommends docker.io debootstrap iproute2 \
        openssh-server openssh-client >/dev/null
fi

engine_answers() { # SOCKET: true when an engine answers /_ping there
    python3 - "$1" <<'PY'
import socket, sys
sock = socket.socket(socket.AF_UNIX)
sock.settimeout(2)
try:
    sock.connect(sys.argv[1])
    sock.sendall(b"GET /_ping HTTP/1.0\r\nHost: docker\r\n\r\n")
    answered = sock.recv(64).split(b" ")[1:2] == [b"200"]
except OSError:
    answered = False
sys.exit(0 if answered else 1)
PY
}

# An engine of our own when none answers on the default socket (or GATEWAY_TEST_DOCKER_HOST's):
# its own data root, exec root, pid file and socket in a temporary directory; stopped at exit
# by the pid it wrote (or, if it wrote none, its launcher's), and only if this script started
# it. GATEWAY_CI_DOCKERD_FLAGS: extra dockerd flags. Hazard: with
# "--bridge none" dockerd deletes the docker0 bridge, breaking any other engine that uses it.
docker_socket=${GATEWAY_TEST_DOCKER_HOST:-unix:///var/run/docker.sock}
docker_socket=${docker_socket#unix://}
ci_dockerd_dir=""
ci_dockerd_launcher=""
stop_ci_dockerd() {
    [ -n "$ci_dockerd_dir" ] || return 0
    local pid=$ci_dockerd_launcher
    [ -s "$ci_dockerd_dir/dockerd.pid" ] && pid=$(cat "$ci_dockerd_dir/dockerd.pid")
    [ -n "$pid" ] && $sudo kill -TERM "$pid" 2>/dev/null || return 0
    for _ in $(seq 1 100); do
        $sudo kill -0 "$pid" 2>/dev/null || break
        sleep 0.2
    done
    # The engine leaves its network namespaces' bind mounts behind: unmount them first.
    local mount
    for mount in "$ci_dockerd_dir"/exec/netns/*; do
        [ -e "$mount" ] && $sudo umount "$mount" 2>/dev/null
    done
    $sudo rm -rf "$ci_dockerd_dir"
}
if ! engine_answers "$docker_socket"; then
    ci_dockerd_dir=$(mktemp -d /tmp/gateway-ci-dockerd.XXXXXX)
    on_exit stop_ci_dockerd
    # shellcheck disable=SC2086 # the extra flags are words
    $sudo dockerd --host "unix://$ci_dockerd_dir/docker.sock" --group "$(id -gn)" \
        --data-root "$ci_dockerd_dir/data" --exec-root "$ci_dockerd_dir/exec" \
        --pidfile "$ci_dockerd_dir/dockerd.pid" ${GATEWAY_CI_DOCKERD_FLAGS:-} \
        >"$ci_dockerd_dir/dockerd.log" 2>&1 &
    ci_dockerd_launcher=$!
    docker_socket=$ci_dockerd_dir/docker.sock
    for _ in $(seq 1 150); do
        engine_answers "$docker_socket" && break
        sleep 0.2
    done
    engine_answers "$docker_socket" || { tail -20 "$ci_dockerd_dir/dockerd.log"; exit 1; }
fi

# Local images made from Debian minbase (no registry is needed): the test image, and the
# build and run bases of the project's Dockerfile (tests/e2e/test_image.py builds it with them:
# python3 at /usr/bin/python3 in both, the same release). Each rootfs tarball is built once and
# cached, named by its suite and packages; an image is imported from it when the engine lacks
# it or holds one made from another package list (its label names the tarball).
suite=bookworm
cache=/var/cache/gateway-ci
import_rootfs() { # IMAGE PACKAGES (comma-separated, for debootstrap --include)
    local image=$1 packages=$2 tarball rootfs
    tarball=$cache/rootfs-$suite-${packages//,/-}.tar
    [ "$(docker -H "unix://$docker_socket" image inspect "$image" \
        --format '{{index .Config.Labels "gateway.ci.rootfs"}}' 2>/dev/null)" \
        = "${tarball##*/}" ] && return 0
    if [ ! -s "$tarball" ]; then
        $sudo mkdir -p "$cache"
        rootfs=$(mktemp -d /tmp/gateway-ci-rootfs.XXXXXX)
        $sudo debootstrap --variant=minbase --include="$packages" "$suite" "$rootfs" \
            http://deb.debian.org/debian >/dev/null
        $sudo rm -rf "$rootfs"/var/lib/apt/lists/* "$rootfs"/var/cache/apt/archives/*.deb
        $sudo tar -C "$rootfs" -c . | $sudo tee "$tarball.partial" >/dev/null
        $sudo mv "$tarball.partial" "$tarball"
        $sudo rm -rf "$rootfs"
    fi
    # An imported image has no environment: PATH and LANG as the official images set them.
    docker -H "unix://$docker_socket" import \
        --change "LABEL gateway.ci.rootfs=${tarball##*/}" \
        --change "ENV PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin" \
        --change "ENV LANG=C.UTF-8" \
        - "$image" <"$tarball" >/dev/null
}
test_image=local/$suite-python:test
build_base=local/$suite-build:ci
run_base=local/$suite-run:ci
import_rootfs "$test_image" python3
# The build stage: a venv, pip from PyPI (ca-certificates) and mypyc (gcc, the headers).
import_rootfs "$build_base" python3,python3-venv,python3-dev,gcc,libc6-dev,ca-certificates
# The run stage: python3 for the copied venv; passwd (useradd) is in minbase.
import_rootfs "$run_base" python3,ca-certificates
export GATEWAY_TEST_DOCKER_HOST=unix://$docker_socket GATEWAY_TEST_IMAGE=$test_image
export GATEWAY_TEST_BUILD_BASE=$build_base GATEWAY_TEST_RUN_BASE=$run_base
# The machine's own CA certificates (what update-ca-certificates adds to its bundle): the image
# build's pip trusts them too, for a machine whose TLS to the package index passes a proxy.
export GATEWAY_TEST_BUILD_CA_CERTS=/usr/local/share/ca-certificates
