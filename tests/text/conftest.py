"""The text tests run on the embedded model's tokenizer."""

from tests.embedded_model import embedded_folder, tokenizer  # noqa: F401
