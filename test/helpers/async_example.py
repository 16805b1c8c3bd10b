"""examples/llm_grpo_async.py imported as its tests need it, and its tiny settings."""

from __future__ import annotations

import contextlib
import importlib.util
import sys
from pathlib import Path

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"
TINY = ["--prompts-per-step", "4", "--group-size", "4", "--minibatch", "8", "--eval-prompts", "50"]


@contextlib.contextmanager
def async_example():
    """The example's module, imported as when it runs as a script (its folder on ``sys.path``:
    it imports ``llm_grpo``) and registered under its name (the sampler process unpickles its
    functions); both undone on exit."""
    sys.path.insert(0, str(EXAMPLES))
    try:
        spec = importlib.util.spec_from_file_location(
            "llm_grpo_async", EXAMPLES / "llm_grpo_async.py"
        )
        module = importlib.util.module_from_spec(spec)
        sys.modules["llm_grpo_async"] = module
        spec.loader.exec_module(module)
        yield module
    finally:
        sys.path.remove(str(EXAMPLES))
        sys.modules.pop("llm_grpo_async", None)
