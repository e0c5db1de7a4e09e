# The tiny models, built once, and the MLA model's reference answers.
from tests.integrations.conftest import mla_model, mla_reference, model  # noqa: F401
