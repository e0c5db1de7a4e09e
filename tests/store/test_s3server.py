"""The S3 test server (tests/s3server.py) through obstore, the S3 client kvpool uses."""

from __future__ import annotations

import os
import time
from datetime import timedelta
from typing import TYPE_CHECKING

import obstore
import pytest
from obstore.exceptions import BaseError, PermissionDeniedError
from obstore.store import S3Store

from tests.s3server import S3Server

if TYPE_CHECKING:
    from obstore.store import ClientConfig

MiB = 1 << 20


def s3_store(
    server: S3Server, bucket: str, *, secret: str | None = None, timeout: str | None = None
) -> S3Store:
    client_options: ClientConfig = {"allow_http": True}
    if timeout is not None:
        client_options["timeout"] = timeout
    return S3Store(
        bucket,
        endpoint=server.endpoint,
        access_key_id=server.access_key,
        secret_access_key=server.secret_key if secret is None else secret,
        region=server.region,
        virtual_hosted_style_request=False,
        client_options=client_options,
        retry_config={"max_retries": 0, "retry_timeout": timedelta(seconds=1)},
    )


def test_put_get_range_and_auth(s3_server: S3Server, s3_bucket: str) -> None:
    store = s3_store(s3_server, s3_bucket)
    data = os.urandom(2 * MiB)
    obstore.put(store, "blocks/one", data)

    assert bytes(obstore.get(store, "blocks/one").bytes()) == data
    assert (
        bytes(obstore.get_range(store, "blocks/one", start=MiB, end=MiB + 100))
        == data[MiB : MiB + 100]
    )
    assert obstore.head(store, "blocks/one")["size"] == 2 * MiB

    with pytest.raises(PermissionDeniedError, match="SignatureDoesNotMatch"):
        obstore.get(s3_store(s3_server, s3_bucket, secret="wrong" + s3_server.secret_key), "x")


def test_freeze_and_thaw(s3_server: S3Server, s3_bucket: str) -> None:
    store = s3_store(s3_server, s3_bucket, timeout="1s")
    obstore.put(store, "k", b"v")
    s3_server.freeze()
    try:
        began = time.monotonic()
        with pytest.raises(BaseError):
            obstore.get(store, "k")
        assert time.monotonic() - began < 3
    finally:
        s3_server.thaw()
    assert bytes(obstore.get(store, "k").bytes()) == b"v"


def test_gateway_restart_keeps_data(s3_server: S3Server, s3_bucket: str) -> None:
    store = s3_store(s3_server, s3_bucket, timeout="5s")
    obstore.put(store, "k", b"kept")
    s3_server.kill_gateway()
    with pytest.raises(BaseError):
        obstore.get(store, "k")
    s3_server.restart_gateway()
    assert bytes(obstore.get(store, "k").bytes()) == b"kept"
