"""An upgrade keeps the pool: a node of the previous release (built from git) fills its
arena, journal and disk tier; this release starts on the same files, adopts every block the
old node held, and serves each one verified.  Clients of either release talk to nodes of the
other (the protocol's window)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from kvpool import Client, Status
from kvpool.formats import RELEASE, UNSTAMPED_RELEASE
from kvpool.harness.process import NodeProcess, wait_until
from kvpool.harness.releases import PREVIOUS, release_env
from kvpool.store import journal as journal_module
from tests.commands import run_kvpool, serve
from tests.helpers import key
from tests.releases import block, previous_src, previous_version, run_previous_client

NUM_BLOCKS = 100_000
BLOCK_BYTES = 4096
MEMORY = "448MiB"  # the 100k blocks, and room: the extra blocks push the oldest to disk
NUM_EXTRA = 12_000
DELETED = 100


@pytest.fixture(scope="module")
def previous(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return previous_src(tmp_path_factory.mktemp("releases"))


FILL = """
for start in range(0, num_blocks, 2000):
    keys = [bytes.fromhex(k) for k in keys_hex[start : start + 2000]]
    result = client.put(keys, [block(k, block_bytes) for k in keys])
    assert all(s.name in ("OK", "EXISTS") for s in result.statuses), result.statuses[:3]
gone = [bytes.fromhex(k) for k in deleted_hex]
client.delete(gone)
present = []
for start in range(0, num_blocks, 8000):
    present += client.exists([bytes.fromhex(k) for k in keys_hex[start : start + 8000]])
emit({"version": kvpool.__version__, "present": present})
"""

CHECK = """
keys = [bytes.fromhex(k) for k in keys_hex]
result = client.get(keys)
wrong = [
    k.hex() for k, v in zip(keys, result.values) if v is None or bytes(v) != block(k, block_bytes)
]
emit({"wrong": wrong})
"""


def _read_verified(client: Client, keys: list[bytes]) -> None:
    """Every block of ``keys`` read and equal to what was written.  A block that a
    promotion from disk just evicted from DRAM (the arena is full) is on its way to the
    disk, a miss for that moment: it is read again once the disk has it."""
    result = client.get(keys)
    missed = []
    for k, status, value in zip(keys, result.statuses, result.values, strict=True):
        if status is Status.OK:
            assert bytes(value) == block(k, BLOCK_BYTES)
        else:
            missed.append(k)
    if missed:
        assert wait_until(lambda: all(client.exists(missed)), 10), len(missed)
        _read_verified(client, missed)


def test_previous_release_files_adopted(previous: Path, run_dir: Path, tmp_path: Path) -> None:
    """100k blocks of a 0.1.0 node (DRAM and disk, with deletes) are all found and verified
    by this release after the upgrade, each file migrated in place; a second start finds
    them in this release's formats."""
    assert previous_version(previous) == PREVIOUS.tag.removeprefix("v")
    disk = tmp_path / "disk"
    args = ["--disk", str(disk), "--disk-size", "256MiB", "--scrub-rate", "0"]
    keys = [key(f"up-{i}") for i in range(NUM_BLOCKS + NUM_EXTRA)]
    deleted = keys[1000 : 1000 + DELETED]

    old = NodeProcess.private(
        "up", MEMORY, run_dir=str(run_dir), extra=args, env=release_env(previous)
    ).start()
    try:
        with Client(old.unix_address, timeout=10) as client:  # this release's client, old node
            assert client.lookup(keys[:1]) == 0
        filled = run_previous_client(
            previous,
            old.unix_address,
            FILL,
            keys_hex=[k.hex() for k in keys],
            deleted_hex=[k.hex() for k in deleted],
            num_blocks=len(keys),
            block_bytes=BLOCK_BYTES,
        )
    finally:
        assert old.stop() == 0
    assert filled["version"] == PREVIOUS.tag.removeprefix("v")
    held = [k for k, present in zip(keys, filled["present"], strict=True) if present]
    assert not set(deleted) & set(held)
    assert len(held) >= NUM_BLOCKS  # the extra blocks pushed the oldest to disk, not out
    assert any(p.name.startswith("seg-") for p in disk.iterdir())

    new = NodeProcess.private("up", MEMORY, run_dir=str(run_dir), extra=args).start()
    try:
        assert new.info["adopted_blocks"] + new.info["disk_blocks"] >= len(held)
        with Client(new.unix_address, timeout=30, verify_reads=True) as client:
            stats = client.stats()
            assert stats.release == RELEASE
            found = {row.name: row.found for row in stats.formats}
            was = f"1 (kvpool {UNSTAMPED_RELEASE})"
            assert found["arena"] == found["journal"] == found["disk tier"] == was, found
            assert "of format 1" in found["disk segment"], found
            for start in range(0, len(held), 8000):  # every block the old node held
                assert all(client.exists(held[start : start + 8000])), start
            for start in range(0, len(held), 4000):
                _read_verified(client, held[start : start + 4000])
            assert not any(client.exists(deleted))  # a delete of 0.1.0's lasts
            assert client.stats().corrupt_reports == 0
        status = run_kvpool("status", "--address", new.unix_address, env={"COLUMNS": "200"})
        assert "formats" in status.stdout and UNSTAMPED_RELEASE in status.stdout, status.stdout
        # The previous release's client reads from this release's node.
        checked = run_previous_client(
            previous,
            new.unix_address,
            CHECK,
            keys_hex=[k.hex() for k in held[-500:]],  # read last, so in DRAM: no miss
            block_bytes=BLOCK_BYTES,
        )
        assert checked["wrong"] == []
    finally:
        assert new.stop() == 0

    again = NodeProcess.private("up", MEMORY, run_dir=str(run_dir), extra=args).start()
    try:
        with Client(again.unix_address, timeout=10) as client:
            rows = {row.name: row for row in client.stats().formats}
            assert rows["journal"].found == f"2 (kvpool {RELEASE})"
            assert rows["arena"].found == f"2 (kvpool {RELEASE})"
            assert rows["disk tier"].found == f"2 (kvpool {RELEASE})"
            assert client.lookup(held[-100:]) == 100
    finally:
        again.stop()
    assert os.path.exists(run_dir / "up" / "arena")


def test_a_node_of_a_format_it_does_not_read_is_refused_at_start(run_dir: Path) -> None:
    """A journal of a later format (a downgrade) stops the start with a message naming both
    versions and how to empty the node; nothing is emptied silently, and --fresh starts."""
    node = NodeProcess.private("later", "8MiB", run_dir=str(run_dir)).start()
    with Client(node.unix_address, timeout=10) as client:
        assert client.put([key("later")], [b"x" * 4096]).all_stored
    assert node.stop() == 0
    journal = run_dir / "later" / "index"
    data = journal.read_bytes()
    header = journal_module.read_header(data, journal)
    assert header is not None
    later = journal_module._header(header.dev, header.ino, header.arena_bytes, version=7)
    journal.write_bytes(later + data[len(later) :])

    refused = serve(run_dir, "--name", "later")
    assert refused.returncode == 2
    message = " ".join(refused.stderr.split())
    assert "journal format 7" in message and RELEASE in message, message
    assert "--fresh" in message, message
    assert journal.read_bytes()[: len(later)] == later  # left as it was

    fresh = NodeProcess.private("later", "8MiB", run_dir=str(run_dir), extra=["--fresh"]).start()
    try:
        with Client(fresh.unix_address, timeout=10) as client:
            assert client.lookup([key("later")]) == 0
    finally:
        fresh.stop()


# A few blocks a put, a moment apart: the disk's write-back keeps up with what DRAM evicts.
FILL_SLOWLY = """
import time
keys = [bytes.fromhex(k) for k in keys_hex]
for start in range(0, len(keys), 8):
    client.put(keys[start : start + 8], [block(k, block_bytes) for k in keys[start : start + 8]])
    time.sleep(0.02)
time.sleep(1)
emit({"present": client.exists(keys)})
"""


CHECK_SLOWLY = """
keys = [bytes.fromhex(k) for k in keys_hex]
wrong = []
for start in range(0, len(keys), 8):
    batch = keys[start : start + 8]
    values = client.get(batch).values
    for k, v in zip(batch, values):
        if v is None or bytes(v) != block(k, block_bytes):
            wrong.append(k.hex())
emit({"wrong": wrong})
"""


def _files(*directories: Path) -> dict[str, tuple[int, str]]:
    """Every file under ``directories``: its length and a digest of its bytes."""
    import hashlib

    found = {}
    for directory in directories:
        for path in sorted(directory.rglob("*")):
            if path.is_file() and not path.is_symlink():
                digest = hashlib.blake2b(path.read_bytes(), digest_size=16).hexdigest()
                found[str(path)] = (path.stat().st_size, digest)
    return found


@pytest.mark.parametrize("refusal", ["disk directory", "port in use"])
def test_a_refused_start_leaves_every_file_as_it_found_it(
    refusal: str, previous: Path, run_dir: Path, tmp_path: Path
) -> None:
    """The previous release's node (arena, journal, disk tier) holds 320 blocks of 64 KiB
    (20 MiB: its 16 MiB arena, and the disk below it); this release
    is started on its files and refused late (the disk directory's parent writable by
    everyone, which this release refuses; or the data port taken), after it has read every
    format.  Every file of the node is as it was, contents and length (before the fix the
    arena had grown by its header page, 16,777,216 -> 16,781,312 bytes), and the previous
    release, started again, finds every block.  (The disk tier's writes are deferred in the
    same way: not its identity file, nor a segment removed.)"""
    parent = tmp_path / "shared"
    parent.mkdir()
    disk = parent / "disk"
    args = ["--disk", str(disk), "--disk-size", "64MiB", "--scrub-rate", "0"]
    keys = [key(f"refused-{i}") for i in range(320)]
    old = NodeProcess.private(
        "refused", "16MiB", run_dir=str(run_dir), extra=args, env=release_env(previous)
    ).start()
    try:
        filled = run_previous_client(
            previous,
            old.unix_address,
            FILL_SLOWLY,
            keys_hex=[k.hex() for k in keys],
            block_bytes=64 << 10,
        )
    finally:
        assert old.stop() == 0
    assert sum(filled["present"]) >= 300  # a write-back may drop a few: the disk is a cache
    keys = [k for k, present in zip(keys, filled["present"], strict=True) if present]
    node_dir = run_dir / "refused"
    before = _files(node_dir, disk)
    assert any("seg-" in name for name in before)
    assert (node_dir / "arena").stat().st_size == 16 << 20  # the previous format: no header

    refused_args = ["--name", "refused", "--memory", "16MiB", *args]
    if refusal == "disk directory":
        parent.chmod(0o777)  # anyone may swap the disk directory: this release refuses it
        refused = serve(run_dir, *refused_args)
        parent.chmod(0o755)
    else:
        import socket

        with socket.create_server(("127.0.0.1", 0)) as taken:
            port = str(taken.getsockname()[1])
            refused = serve(run_dir, *refused_args, "--port", port)
    assert refused.returncode != 0, refused.stdout
    assert _files(node_dir, disk) == before

    again = NodeProcess.private(
        "refused", "16MiB", run_dir=str(run_dir), extra=args, env=release_env(previous)
    ).start()
    try:
        checked = run_previous_client(
            previous,
            again.unix_address,
            CHECK_SLOWLY,
            keys_hex=[k.hex() for k in keys],
            block_bytes=64 << 10,
        )
        assert checked["wrong"] == []
        assert again.info["adopted_blocks"] + again.info.get("disk_blocks", 0) >= len(keys)
    finally:
        again.stop()
