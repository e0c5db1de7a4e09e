import os
from collections.abc import Callable

import pytest

from kvpool.harness.tiny_model import build_tiny_model

# Family -> directory: built once per session, also for the directories that import these
# fixtures (each import is a fixture of its own).
_BUILT: dict[str, str] = {}


def tiny_model(tmp_path_factory, family: str) -> str:
    """The tiny model of ``family``, built once per session (or found in KVPOOL_CACHE_DIR)."""
    if family not in _BUILT:
        cache = os.environ.get("KVPOOL_CACHE_DIR")
        target = (
            os.path.join(cache, f"tiny-{family}")
            if cache
            else str(tmp_path_factory.mktemp("model") / f"tiny-{family}")
        )
        _BUILT[family] = str(build_tiny_model(target, family=family))
    return _BUILT[family]


@pytest.fixture(scope="session")
def family_model(tmp_path_factory) -> Callable[[str], str]:
    """``family_model("gemma3")``: the tiny model of a family (:func:`tiny_model`)."""

    def build(family: str) -> str:
        return tiny_model(tmp_path_factory, family)

    return build


@pytest.fixture(scope="session")
def model(tmp_path_factory) -> str:
    """The tiny Llama."""
    return tiny_model(tmp_path_factory, "llama")


@pytest.fixture(scope="session")
def mla_model(tmp_path_factory) -> str:
    """The tiny DeepSeek-V3 shape: multi-head latent attention (MLA), dense MLPs."""
    return tiny_model(tmp_path_factory, "deepseek-v3")


@pytest.fixture(scope="session")
def mla_reference(mla_model, engines) -> dict:
    """The MLA model's answers without a connector, one prompt at a time, fresh and from
    its own prefix cache (see tests/integrations/mla.py)."""
    from tests.integrations.mla import reference_answers

    return reference_answers(mla_model, engines)
