"""Settings every test process (and the servers it starts) runs with."""

from __future__ import annotations

import os

# Nothing may reach a model hub: tests lay out whatever hub cache they need themselves.
os.environ["HF_HUB_OFFLINE"] = "1"
