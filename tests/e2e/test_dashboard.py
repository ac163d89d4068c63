"""The dashboard `keel server` serves at `/`, in headless Chromium: with NBD and S3 traffic
running, its per-volume and per-bucket tables and charts show the traffic, its slow-request
table lists the requests, and without the admin token it asks for one. A screenshot is saved
in the test's work directory (dashboard.png; kept when the test fails, or with
KEEL_KEEP_TEST_DATA=1)."""

import json

from browser import Browser
from conftest import Traffic, require, s3_client, wait_for

STATE = """JSON.stringify({
  health: document.getElementById("health").textContent,
  login: getComputedStyle(document.getElementById("login")).display,
  volumeOps: (r => r ? Number(r.dataset.ops) : null)(document.querySelector('#volumes tr[data-name="dashvol"]')),
  bucketOps: (r => r ? Number(r.dataset.ops) : null)(document.querySelector('#buckets tr[data-name="dashbucket"]')),
  volumeLines: [...document.querySelectorAll('#volume-charts polyline')].map(
      p => [p.dataset.series, p.getAttribute("points").split(" ").filter(Boolean).length]),
  bucketLines: [...document.querySelectorAll('#bucket-charts polyline')].map(
      p => [p.dataset.series, p.getAttribute("points").split(" ").filter(Boolean).length]),
  deviceCharts: document.querySelectorAll('#device-charts svg').length,
  ops: [...document.querySelectorAll('#ops tbody tr')].map(
      r => [r.dataset.frontend, r.dataset.operation, r.cells[3].textContent]),
})"""


def state(browser, session):
    """The page's state, or None while it is still loading."""
    raw = browser.evaluate(session, f"(() => {{ try {{ return {STATE}; }} catch (e) {{ return null; }} }})()")
    return json.loads(raw) if raw else None



def test_the_dashboard_shows_live_traffic_and_slow_requests(server, workdir):
    require("chromium", "chromium")
    server.cli("volume", "create", "dashvol", "--size", "16M")
    s3_client(server).create_bucket(Bucket="dashbucket")
    with Traffic(server, "dashvol", "dashbucket", pause=0.005):
        browser = Browser(workdir / "chromium-profile")
        try:
            token = (server.data_dirs[0] / "admin-token").read_text().strip()
            signed_in = browser.open(f"http://{server.admin}/#token={token}")

            def charted():
                seen = state(browser, signed_in)
                if seen is None:
                    return None
                lines = dict(seen["volumeLines"])
                return seen if (seen["volumeOps"] or 0) > 0 and (seen["bucketOps"] or 0) > 0 \
                    and lines.get("IOPS", 0) >= 2 and seen["ops"] else None

            seen = wait_for("the charts and tables to show the traffic", charted, interval=0.5)
            browser.screenshot(signed_in, workdir / "dashboard.png")
            assert seen["health"].startswith("HEALTH_"), seen["health"]
            assert seen["login"] == "none", "signed in: no prompt"
            assert {series for series, _ in seen["volumeLines"]} == {"IOPS", "MiB/s", "p99"}
            assert dict(seen["bucketLines"]).get("req/s", 0) >= 2, seen["bucketLines"]
            assert seen["deviceCharts"] == 3
            frontends = {(frontend, operation) for frontend, operation, _ in seen["ops"]}
            targets = [target for _, _, target in seen["ops"]]
            assert ("nbd", "write") in frontends or ("s3", "PUT") in frontends, seen["ops"]
            assert all(t.startswith("dashvol") or t.startswith("dashbucket") for t in targets), targets

            # A tab without the token asks for it and shows no requests; signing in fills them.
            anonymous = browser.open(f"http://{server.admin}/")
            prompted = wait_for("the sign-in prompt",
                                lambda: (s := state(browser, anonymous)) and s["login"] == "block" and s,
                                interval=0.5)
            assert prompted["ops"] == []
            browser.evaluate(anonymous, f"""document.getElementById("token").value = {json.dumps(token)};
                document.getElementById("login").requestSubmit(); true""")
            wait_for("requests after signing in", lambda: (state(browser, anonymous) or {}).get("ops"),
                     interval=0.5)
            assert state(browser, anonymous)["login"] == "none"
        finally:
            browser.close()
    assert (workdir / "dashboard.png").stat().st_size > 10_000
