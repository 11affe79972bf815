import os
import tempfile

import pytest


@pytest.fixture
def nvme_dir():
    """A directory on a real filesystem (ext4 /tmp here) for NVMe tier files."""
    with tempfile.TemporaryDirectory(prefix="ps-pytest-") as path:
        yield path
    assert not os.path.exists(path)


def pytest_collection_modifyitems(config, items):
    """Marks as slow what the default run leaves to tools/test.sh --full (Note [The default run
    and --full] in run_selection.py)."""
    import run_selection

    later, unmatched = run_selection.deferred(
        [item.nodeid for item in items],
        [getattr(getattr(item, "callspec", None), "params", {}) for item in items],
        [getattr(getattr(item, "callspec", None), "id", None) for item in items])
    if unmatched:
        raise pytest.UsageError("run_selection.py names tests that were not collected: "
                                + ", ".join(sorted(unmatched)))
    for index in later:
        items[index].add_marker(pytest.mark.slow)
