"""The SGLang tests run in the SGLang environment (``make test`` makes it: see
docs/testing.md); collected elsewhere, they are skipped with that reason."""

import pytest

pytest.importorskip("sglang", reason="runs in the SGLang environment (.venv-sglang, make test)")
