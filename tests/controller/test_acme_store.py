"""controller/acme/store.py: the files under <state_dir>/acme, their modes, atomic writes, and
certificates read back."""

from __future__ import annotations

import os
import stat
import time
from pathlib import Path

import pytest

from controller.acme.errors import StoreError
from controller.acme.store import AcmeStore, write_atomic

from .test_acme_ca import TestCA

HOST = "app.example.com"


def mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


@pytest.fixture
def store(tmp_path: Path) -> AcmeStore:
    s = AcmeStore(tmp_path / "acme")
    s.prepare()
    return s


def test_prepare_makes_private_directories_and_clears_left_challenges(tmp_path: Path) -> None:
    root = tmp_path / "acme"
    (root / "challenges").mkdir(parents=True, mode=0o755)
    os.chmod(root, 0o755)
    (root / "challenges" / "left-by-a-crash").write_text("x")
    store = AcmeStore(root)
    store.prepare()
    for d in (root, store.account_dir, store.certificates_dir, store.challenges_dir):
        assert mode(d) == 0o700, d
    assert list(store.challenges_dir.iterdir()) == []


def test_a_certificate_is_written_private_and_read_back(store: AcmeStore) -> None:
    ca = TestCA("Example Issuing CA")
    now = time.time()
    issued = ca.issue([HOST, "www.example.com"], now - 60, now + 3600)
    stored = store.write_certificate(HOST, issued.fullchain_pem, issued.key_pem)
    directory = store.certificates_dir / HOST
    assert (directory / "fullchain.pem").read_bytes() == issued.fullchain_pem
    assert (directory / "privkey.pem").read_bytes() == issued.key_pem
    assert mode(directory) == 0o700
    assert mode(directory / "privkey.pem") == 0o600
    assert mode(directory / "fullchain.pem") == 0o600
    assert [p.name for p in directory.iterdir() if p.name.startswith(".")] == []  # no temp left
    again = store.certificate(HOST)
    assert again == stored
    assert again is not None
    assert again.certificate.names == (HOST, "www.example.com")
    assert again.issuer == "Example Issuing CA"
    assert again.certificate.not_before == pytest.approx(int(now - 60), abs=1)
    assert again.certificate.not_after == pytest.approx(int(now + 3600), abs=1)
    assert store.certificate("other.example.com") is None


def test_a_pair_that_does_not_match_is_refused_and_the_old_one_stays(store: AcmeStore) -> None:
    ca = TestCA()
    now = time.time()
    good = ca.issue([HOST], now, now + 60)
    store.write_certificate(HOST, good.fullchain_pem, good.key_pem)
    other = ca.issue([HOST], now, now + 60)
    with pytest.raises(StoreError, match=r"privkey\.pem is not the key of fullchain\.pem"):
        store.write_certificate(HOST, other.fullchain_pem, good.key_pem)
    with pytest.raises(StoreError, match=r"fullchain\.pem is no PEM certificate"):
        store.write_certificate(HOST, b"garbage", good.key_pem)
    stored = store.certificate(HOST)
    assert stored is not None
    assert (store.certificates_dir / HOST / "fullchain.pem").read_bytes() == good.fullchain_pem
    # Files mismatched on disk (a key written, its chain not yet): refused on reading too.
    (store.certificates_dir / HOST / "privkey.pem").write_bytes(other.key_pem)
    with pytest.raises(StoreError, match="not the key"):
        store.certificate(HOST)


@pytest.mark.parametrize("name", ["../etc", "a/b", "", ".hidden", "UPPER.example.com", "a..b"])
def test_certificate_names_that_are_no_dns_name_are_refused(store: AcmeStore, name: str) -> None:
    with pytest.raises(StoreError, match="not a certificate name"):
        store.certificate_dir(name)


def test_challenges_are_written_and_removed(store: AcmeStore) -> None:
    store.put_challenge("tok-EN_1", "tok-EN_1.thumbprint")
    path = store.challenges_dir / "tok-EN_1"
    assert path.read_text() == "tok-EN_1.thumbprint"
    assert mode(path) == 0o600
    store.remove_challenge("tok-EN_1")
    assert not path.exists()
    store.remove_challenge("tok-EN_1")  # twice: no error


@pytest.mark.parametrize("token", ["../x", "a/b", "a.b", "", "x" * 257, "tok\n"])
def test_tokens_that_could_name_another_file_are_refused(store: AcmeStore, token: str) -> None:
    with pytest.raises(StoreError, match="not an HTTP-01 token"):
        store.put_challenge(token, "x")
    assert list(store.challenges_dir.iterdir()) == []


def test_the_account_registration_is_kept_per_directory(store: AcmeStore) -> None:
    assert store.account_key() is None
    store.save_account_key(b"KEY")
    assert store.account_key() == b"KEY"
    assert mode(store.account_dir / "key.pem") == 0o600
    assert store.registration("https://ca.example/dir") is None
    store.save_registration("https://ca.example/dir", '{"uri": "x"}')
    assert store.registration("https://ca.example/dir") == '{"uri": "x"}'
    assert store.registration("https://other.example/dir") is None  # another CA: not this one
    store.forget_registration()
    assert store.registration("https://ca.example/dir") is None


def test_write_atomic_replaces_whole_and_leaves_no_temp_on_failure(tmp_path: Path) -> None:
    path = tmp_path / "f"
    write_atomic(path, b"one")
    inode = path.stat().st_ino
    write_atomic(path, b"two")
    assert path.read_bytes() == b"two"
    assert path.stat().st_ino != inode  # a new file renamed over the old one
    with pytest.raises(TypeError):  # fails mid-write: the old file stays, no temp is left
        write_atomic(path, "not bytes")  # type: ignore[arg-type]
    assert path.read_bytes() == b"two"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["f"]
