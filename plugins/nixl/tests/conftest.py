"""Set-up shared by the NIXL plugin tests: where the plugin is, and the agents fixture.

The agents' child processes inherit NIXL_PLUGIN_DIR from here. scripts/test-nixl builds the
plugin and sets it; run directly, the suite looks in target/nixl-plugins."""

import os
import pathlib
import sys

import pytest

HERE = pathlib.Path(__file__).resolve().parent
ROOT = HERE.parents[2]
sys.path.insert(0, str(HERE))

from harness import Agents  # noqa: E402

PLUGIN_DIR = pathlib.Path(os.environ.get("NIXL_PLUGIN_DIR") or ROOT / "target" / "nixl-plugins")
PLUGIN = PLUGIN_DIR / "libplugin_MULTIRAIL.so"
os.environ["NIXL_PLUGIN_DIR"] = str(PLUGIN_DIR)
# NIXL logs every backend creation at INFO; the tests' own output is what matters.
os.environ.setdefault("NIXL_LOG_LEVEL", "WARN")


def pytest_sessionstart(session):
    if not PLUGIN.is_file():
        pytest.exit(f"{PLUGIN} not found: build it with scripts/nixl-plugin, or run scripts/test-nixl", 2)


@pytest.fixture
def agents():
    a = Agents()
    yield a
    a.close()


@pytest.fixture
def plugin_path():
    return PLUGIN
