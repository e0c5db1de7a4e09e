import os
from collections.abc import Callable

import pytest

from kvpool.harness.tiny_model import build_tiny_model


@pytest.fixture(scope="session")
def family_model(tmp_path_factory) -> Callable[[str], str]:
    """``family_model("gemma3")``: the tiny model of a family, built once per session (or
    found in KVPOOL_CACHE_DIR)."""

    def build(family: str) -> str:
        cache = os.environ.get("KVPOOL_CACHE_DIR")
        target = (
            os.path.join(cache, f"tiny-{family}")
            if cache
            else str(tmp_path_factory.getbasetemp() / "models" / f"tiny-{family}")
        )
        return str(build_tiny_model(target, family=family))

    return build


@pytest.fixture(scope="session")
def model(family_model) -> str:
    """The suite's tiny Llama."""
    return family_model("llama")
