"""Headless Chromium driven over the DevTools protocol on a pipe (`--remote-debugging-pipe`:
JSON messages ending in a NUL byte, read from fd 3 and written to fd 4), so tests load a page,
let its scripts run in real time, then read its DOM and take a screenshot, with nothing beyond
the Debian chromium package."""

import base64
import fcntl
import json
import os
import select
import subprocess
import time


def above_ten(fd):
    moved = fcntl.fcntl(fd, fcntl.F_DUPFD_CLOEXEC, 10)
    os.close(fd)
    return moved


class Browser:
    def __init__(self, profile_dir, timeout=30):
        self.timeout = timeout
        # Chromium's ends move above fd 10 first, so that placing them at 3 and 4 in the
        # child never lands one on the other (dup2 onto itself would also keep close-on-exec).
        to_chrome_r, self._to_chrome = (above_ten(fd) for fd in os.pipe())
        self._from_chrome, from_chrome_w = (above_ten(fd) for fd in os.pipe())

        def wire_pipes():
            os.dup2(to_chrome_r, 3)
            os.dup2(from_chrome_w, 4)

        self.proc = subprocess.Popen(
            ["chromium", "--headless=new", "--no-sandbox", "--disable-gpu", "--no-first-run",
             "--disable-extensions", "--remote-debugging-pipe", f"--user-data-dir={profile_dir}",
             "--window-size=1280,2000", "about:blank"],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, preexec_fn=wire_pipes, close_fds=False)
        os.close(to_chrome_r)
        os.close(from_chrome_w)
        self._next_id = 0
        self._buffer = b""

    def call(self, method, params=None, session=None):
        self._next_id += 1
        message = {"id": self._next_id, "method": method, "params": params or {}}
        if session:
            message["sessionId"] = session
        os.write(self._to_chrome, json.dumps(message).encode() + b"\0")
        deadline = time.time() + self.timeout
        while True:
            while b"\0" not in self._buffer:
                left = deadline - time.time()
                if left <= 0 or not select.select([self._from_chrome], [], [], left)[0]:
                    raise TimeoutError(f"no answer to {method}")
                chunk = os.read(self._from_chrome, 1 << 20)
                if not chunk:
                    raise RuntimeError("chromium exited")
                self._buffer += chunk
            raw, self._buffer = self._buffer.split(b"\0", 1)
            answer = json.loads(raw)
            if answer.get("id") == self._next_id:
                if "error" in answer:
                    raise RuntimeError(f"{method}: {answer['error']}")
                return answer["result"]

    def open(self, url):
        """A new tab on `url`; returns its session."""
        target = self.call("Target.createTarget", {"url": url})["targetId"]
        return self.call("Target.attachToTarget", {"targetId": target, "flatten": True})["sessionId"]

    def evaluate(self, session, expression):
        result = self.call("Runtime.evaluate", {"expression": expression, "returnByValue": True}, session)
        return result["result"].get("value")

    def screenshot(self, session, path):
        data = self.call("Page.captureScreenshot", {"format": "png", "captureBeyondViewport": True}, session)["data"]
        with open(path, "wb") as out:
            out.write(base64.b64decode(data))

    def close(self):
        try:
            self.call("Browser.close")
        except (RuntimeError, TimeoutError, OSError):
            pass
        try:
            self.proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        os.close(self._to_chrome)
        os.close(self._from_chrome)
