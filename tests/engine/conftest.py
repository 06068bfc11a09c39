"""The embedded model's folder and tokenizer, for the engine tests that check them."""

from tests.embedded_model import embedded_folder, tokenizer  # noqa: F401
