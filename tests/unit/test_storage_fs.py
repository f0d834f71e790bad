"""raytrn.storage's S3 filesystem is made once a process for its settings (the AWS SDK's client takes ~30 ms to make,
and every storage call asks for one), and made again when the settings it was made under change."""

from __future__ import annotations

import pytest

from raytrn import storage

pytestmark = pytest.mark.unit


def _endpoint(fs: object) -> str:
    return fs.__reduce__()[1][0]["endpoint_override"]  # type: ignore[attr-defined,no-any-return]


def test_one_filesystem_for_the_same_settings_another_when_they_change(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("AWS_ENDPOINT_URL", "http://127.0.0.1:9")
    monkeypatch.delenv("AWS_ENDPOINT_URL_S3", raising=False)
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "a")
    first = storage.s3_filesystem()
    assert storage.filesystem("s3://bucket/run/dcp")[0] is first and _endpoint(first) == "127.0.0.1:9"
    monkeypatch.setenv("AWS_ENDPOINT_URL", "http://127.0.0.1:10")  # another endpoint
    moved = storage.s3_filesystem()
    assert moved is not first and _endpoint(moved) == "127.0.0.1:10"
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "b")  # other credentials: never a client made with the old ones
    assert storage.s3_filesystem() is not moved
    with storage.quick_checks():  # checks' few attempts and short timeouts: a filesystem of their own
        quick = storage.s3_filesystem()
        assert quick is storage.s3_filesystem()
    assert quick is not storage.s3_filesystem()
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "a")
    monkeypatch.setenv("AWS_ENDPOINT_URL", "http://127.0.0.1:9")
    assert storage.s3_filesystem() is first
    monkeypatch.setattr(storage, "S3_ATTEMPTS", 1)  # fewer attempts (a test's): a filesystem with that strategy
    assert storage.s3_filesystem() is not first
