"""The decode tests share the prefill tests' in-process gateway socket."""

from tests.prefill.conftest import gateway  # noqa: F401
