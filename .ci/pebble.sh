# Sourced by .ci/run: pebble, Let's Encrypt's ACME test server (Debian package "pebble"), for
# tests/e2e/test_acme.py, which starts and stops its own pebble on loopback: nothing to clean.
if ! command -v pebble >/dev/null; then
    $sudo apt-get update -qq
    $sudo env DEBIAN_FRONTEND=noninteractive \
        apt-get install -y -qq --no-install-recommends pebble >/dev/null
fi
