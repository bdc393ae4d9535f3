"""The engine core (scheduler, block manager, sequences, sampling params, stop checks) stays torch-free."""

from __future__ import annotations

import subprocess
import sys

CHECK = """
import sys
import app.engine.core
from app.engine import SamplingParams
assert SamplingParams is app.engine.core.SamplingParams
heavy = sorted(m for m in sys.modules if m == "torch" or m.startswith("torch."))
outside = sorted(m for m in sys.modules if m.startswith("app.") and not m.startswith("app.engine.core")
                 and m != "app.engine")
print(heavy, outside)
assert not heavy and not outside
"""


def test_the_engine_core_imports_no_torch() -> None:
    result = subprocess.run([sys.executable, "-c", CHECK], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stdout + result.stderr
