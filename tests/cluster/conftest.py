"""Fixtures of the multi-process cluster tests (the helpers are in keelcluster.py)."""

import os
import re
import shutil

import pytest

from keelcluster import WORK, Cluster, fs_type


@pytest.fixture
def workdir(request):
    """The test's own directory, removed once the test passed (its nodes stopped by then)
    unless KEEL_KEEP_TEST_DATA=1: a failed test's stays for its logs. Kept, the suite's data
    came to 6 GiB."""
    name = re.sub(r"[^A-Za-z0-9_.-]", "_", request.node.name)
    path = WORK / name
    shutil.rmtree(path, ignore_errors=True)
    path.mkdir(parents=True)
    assert fs_type(path) not in ("tmpfs", "ramfs"), f"{path} is on {fs_type(path)}"
    yield path
    mounted = any(line.split()[1].startswith(str(path) + "/") for line in open("/proc/mounts"))
    if passed(request.node) and not mounted and os.environ.get("KEEL_KEEP_TEST_DATA") != "1":
        shutil.rmtree(path, ignore_errors=True)


def passed(item):
    """Whether every phase of the test that ran so far passed (set by the hook below)."""
    reports = [getattr(item, f"rep_{when}", None) for when in ("setup", "call")]
    return all(report is not None and report.passed for report in reports)


@pytest.fixture
def cluster(workdir):
    c = Cluster(workdir)
    yield c
    c.stop()


# What a failed cluster test shows of its nodes: warnings, errors and the Raft events that
# explain a stall (elections, voter changes, snapshots, shutdowns), the last lines of each.
NOTABLE = re.compile(r" (WARN|ERROR) |becomes leader|steps down|changing the voter set|"
                     r"joined|snapshot|shutting down|stopped")
ANSI = re.compile(r"\x1b\[[0-9;]*m")


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    report = outcome.get_result()
    setattr(item, f"rep_{report.when}", report)
    cluster = item.funcargs.get("cluster") if hasattr(item, "funcargs") else None
    if report.when != "call" or not report.failed or cluster is None:
        return
    for node in cluster.nodes:
        lines = [ANSI.sub("", line)[:220] for line in node.log().splitlines()]
        notable = [line for line in lines if NOTABLE.search(line)][-30:]
        if notable:
            report.sections.append((f"{node.name} log (notable lines)", "\n".join(notable)))
