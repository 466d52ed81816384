"""Make `import tessera` find a build.

Order: $TESSERA_PYTHONPATH (os.pathsep-separated, prepended as is) if set; else an importable tessera (e.g. one
installed with pip) is used; else ${repo}/build/python from an in-tree CMake build, if it exists.
"""

import importlib.util
import os
import sys
from pathlib import Path

_REPO = Path(__file__).resolve().parents[2]


def _prepend(path):
    path = str(path)
    if path not in sys.path:
        sys.path.insert(0, path)


_env = os.environ.get("TESSERA_PYTHONPATH")
if _env:
    for _p in reversed([p for p in _env.split(os.pathsep) if p]):
        _prepend(_p)
elif importlib.util.find_spec("tessera") is None:
    _build = _REPO / "build" / "python"
    if (_build / "tessera").is_dir():
        _prepend(_build)
