import os
import tempfile

import pytest


@pytest.fixture
def nvme_dir():
    """A directory on a real filesystem (ext4 /tmp here) for NVMe tier files."""
    with tempfile.TemporaryDirectory(prefix="ps-pytest-") as path:
        yield path
    assert not os.path.exists(path)
