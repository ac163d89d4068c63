"""Fixtures of the multi-process cluster tests (the helpers are in keelcluster.py)."""

import re
import shutil

import pytest

from keelcluster import WORK, Cluster, fs_type


@pytest.fixture
def workdir(request):
    name = re.sub(r"[^A-Za-z0-9_.-]", "_", request.node.name)
    path = WORK / name
    shutil.rmtree(path, ignore_errors=True)
    path.mkdir(parents=True)
    assert fs_type(path) not in ("tmpfs", "ramfs"), f"{path} is on {fs_type(path)}"
    return path


@pytest.fixture
def cluster(workdir):
    c = Cluster(workdir)
    yield c
    c.stop()
