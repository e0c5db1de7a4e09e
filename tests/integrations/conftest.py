import os

import pytest

from kvpool.harness.tiny_model import build_tiny_model


@pytest.fixture(scope="session")
def model(tmp_path_factory) -> str:
    """The tiny model, built once per session (or found in KVPOOL_CACHE_DIR)."""
    cache = os.environ.get("KVPOOL_CACHE_DIR")
    target = (
        os.path.join(cache, "tiny-llama")
        if cache
        else str(tmp_path_factory.mktemp("model") / "tiny-llama")
    )
    return str(build_tiny_model(target))
