from tests.integrations.conftest import model  # noqa: F401  (the tiny model, built once)
