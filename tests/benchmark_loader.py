"""Import a script of ``benchmarks/`` as a module, for the tests of that script."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"


def load_benchmark(script: str, module_name: str) -> ModuleType:
    """Execute ``benchmarks/<script>`` as the module ``module_name`` (registered in
    ``sys.modules``: dataclasses look their module up by name). ``benchmarks/`` joins
    ``sys.path``, since scripts import their sibling helpers by name."""
    if str(BENCHMARKS) not in sys.path:
        sys.path.insert(0, str(BENCHMARKS))
    spec = importlib.util.spec_from_file_location(module_name, BENCHMARKS / script)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[module_name] = module
    spec.loader.exec_module(module)
    return module
