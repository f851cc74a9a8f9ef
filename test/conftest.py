"""pytest setup of the CPU test suite.

Runs before any test module is imported:

* keeps this repo's ``python/`` directory off ``sys.path``: the tests import
  the sglang installed (and patched by ``scripts/apply_patch.py``) in the
  venv, never the files in this repo;
* sets ``TRITON_INTERPRET=1`` when there is no CUDA device (it must be set
  before triton is imported), so Triton kernels run on the CPU;
* installs the test-only shims of ``cpu_shims`` (torchvision op schemas,
  ``sgl_kernel`` stubs) before sglang is imported;
* stamps a one-GPU parallel layout where sglang reads it from its runtime
  context (0.5.23);
* registers the ``full`` marker: the slow tier, skipped unless pytest runs
  with ``--full`` (``bash scripts/test.sh --full``);
* registers the ``requires_cuda`` marker: ``@pytest.mark.requires_cuda``
  tests are skipped without a CUDA device (``cpu_shims.requires_cuda`` is the
  same as a ``unittest`` decorator);
* loads a hypothesis profile without deadlines (the Triton interpreter is
  slow and its speed varies).
"""

import importlib.util
import os
import sys
from pathlib import Path

import pytest

TEST_DIR = Path(__file__).resolve().parent
REPO_ROOT = TEST_DIR.parent
REPO_PYTHON_DIR = REPO_ROOT / "python"
# Shared helpers, the checkers and the product tests import each other by name.
IMPORT_DIRS = [TEST_DIR / d for d in ("helpers", "checkers", "srt")]


def _drop_repo_python_dir() -> None:
    def is_repo_python(entry: str) -> bool:
        try:
            return Path(entry or os.getcwd()).resolve() == REPO_PYTHON_DIR
        except OSError:
            return False

    sys.path[:] = [entry for entry in sys.path if not is_repo_python(entry)]


_drop_repo_python_dir()
for _dir in IMPORT_DIRS:
    if str(_dir) not in sys.path:
        sys.path.insert(0, str(_dir))

import torch  # noqa: E402

if not torch.cuda.is_available():
    if "triton" in sys.modules and os.environ.get("TRITON_INTERPRET") != "1":
        raise pytest.UsageError(
            "triton was imported before test/conftest.py could set "
            "TRITON_INTERPRET=1; set it in the environment"
        )
    os.environ.setdefault("TRITON_INTERPRET", "1")

import cpu_shims  # noqa: E402

SHIMS = cpu_shims.install_all()


def _check_sglang_location() -> None:
    spec = importlib.util.find_spec("sglang")
    if spec is None or spec.origin is None:
        return  # tests that need it fail on import with a clear error
    origin = Path(spec.origin).resolve()
    if REPO_PYTHON_DIR in origin.parents:
        raise pytest.UsageError(
            f"sglang is imported from this repo ({origin}), not from the venv's "
            "patched install; run the tests with scripts/test.sh"
        )


_check_sglang_location()


cpu_shims.stamp_one_gpu_layout()

try:
    from hypothesis import settings

    settings.register_profile("cpu", deadline=None, print_blob=True)
    settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "cpu"))
except ImportError:  # pragma: no cover - hypothesis is in requirements
    pass


def pytest_addoption(parser):
    parser.addoption(
        "--full",
        action="store_true",
        help="also run the slow tier (tests marked 'full'; see test/README.md)",
    )


def pytest_configure(config):
    config.addinivalue_line(
        "markers", "requires_cuda: the test needs a CUDA device (skipped without)"
    )
    config.addinivalue_line(
        "markers", "full: slow tier, run only with --full (the GPU gate runs it)"
    )


def pytest_collection_modifyitems(config, items):
    skip_full = pytest.mark.skip(reason="slow tier: run with --full")
    skip_cuda = pytest.mark.skip(reason="requires a CUDA device")
    full = config.getoption("--full")
    cuda = cpu_shims.cuda_available()
    for item in items:
        if "full" in item.keywords and not full:
            item.add_marker(skip_full)
        if "requires_cuda" in item.keywords and not cuda:
            item.add_marker(skip_cuda)


def pytest_report_header(config):
    return (
        f"torch {torch.__version__}, cuda={torch.cuda.is_available()}, "
        f"TRITON_INTERPRET={os.environ.get('TRITON_INTERPRET')}, shims={SHIMS}"
    )
