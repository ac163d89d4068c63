"""The LD_PRELOAD that makes a `keel server`'s disk fail a sync (tests/failsync.c), for the
end-to-end and cluster tests."""

import subprocess
from pathlib import Path

SOURCE = Path(__file__).resolve().parents[1] / "failsync.c"


def library(workdir):
    """Builds tests/failsync.c into `workdir`; the environment that loads it into a server,
    and the trigger file whose creation fails that server's next segment sync with EIO."""
    built = workdir / "failsync.so"
    subprocess.run(["cc", "-shared", "-fPIC", "-O2", "-o", str(built), str(SOURCE), "-ldl"], check=True)
    trigger = workdir / "fail-sync"
    return {"LD_PRELOAD": str(built), "KEEL_TEST_FAIL_SYNC": str(trigger)}, trigger
