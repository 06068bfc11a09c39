"""The scripted OpenAI server of the bench tests, for the calibration tests."""

from tests.bench.conftest import scripted_server  # noqa: F401
