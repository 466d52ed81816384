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


# ---- seeds ------------------------------------------------------------------------------------------------------
# Randomized tests take the `seed` fixture: TESSERA_SEED when set (reproduces a run), else a fresh one per session.
# Each test gets its own seed derived from the session seed and its node id, and a failing test's report names
# both, so `TESSERA_SEED=<session seed> pytest -k <test>` replays it.
import hashlib  # noqa: E402
import random  # noqa: E402

import pytest  # noqa: E402

_SESSION_SEED = int(os.environ.get("TESSERA_SEED", "0") or 0) or random.SystemRandom().randrange(1, 2**31)


def pytest_report_header(config):
    return f"TESSERA_SEED={_SESSION_SEED}"


@pytest.fixture
def seed(request):
    digest = hashlib.sha256(f"{_SESSION_SEED}:{request.node.nodeid}".encode()).digest()
    value = int.from_bytes(digest[:4], "little") & 0x7FFFFFFF
    request.node.user_properties.append(("seed", value))
    return value


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    report = outcome.get_result()
    if report.failed and "seed" in getattr(item, "fixturenames", ()):
        report.sections.append(("tessera seed", f"TESSERA_SEED={_SESSION_SEED} (this test's seed: "
                                                f"{dict(item.user_properties).get('seed')})"))
