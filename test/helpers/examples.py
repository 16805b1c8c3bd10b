"""The example scripts as modules: ``load_example(path)`` runs one file of ``examples/`` under its
own name, as the example tests' fixtures need (the examples are scripts, not a package)."""

import importlib.util
from pathlib import Path
from types import ModuleType


def load_example(path: Path, name: str | None = None) -> ModuleType:
    """The module that the script at ``path`` defines (named ``name``, default its file's stem),
    executed once and not registered in ``sys.modules``."""
    spec = importlib.util.spec_from_file_location(name or Path(path).stem, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module
