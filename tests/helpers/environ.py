"""A fixture that restores os.environ after each test of a module that imports it."""
import os

import pytest


@pytest.fixture(autouse=True)
def keep_environ():
    """Importing Accelerate/DeepSpeed sets a few environment variables; later tests' workers must not inherit them."""
    before = dict(os.environ)
    yield
    os.environ.clear()
    os.environ.update(before)
