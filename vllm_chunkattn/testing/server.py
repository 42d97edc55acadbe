"""Start and stop `vllm serve` as a child process, cleanly.

Used by the demo, the server tests and the serving benchmark. The server gets
a free loopback port, its output goes to a log file, and it is stopped (its
whole process group: API server, engine core, workers) on exit, on failure
and on Ctrl-C, so no orphan servers are left behind.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

from vllm_chunkattn.backend.stats import with_run_summary_time
from vllm_chunkattn.metrics import METRICS_DIR_ENV


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ServerError(RuntimeError):
    pass


class VllmServer:
    """`with VllmServer(model, ["--attention-backend", "chunk"]) as server: ...`"""

    def __init__(
        self,
        model: str,
        args: list[str] | None = None,
        log_path: str | os.PathLike | None = None,
        startup_timeout_s: float = 600.0,
        env: dict[str, str] | None = None,
    ) -> None:
        self.model = model
        self.args = list(args or [])
        self.port = free_port()
        self.log_path = Path(log_path or f"/tmp/vllm-serve-{self.port}.log")
        self.startup_timeout_s = startup_timeout_s
        self.env = with_run_summary_time(
            {**os.environ, "VLLM_CPU_KVCACHE_SPACE": os.environ.get("VLLM_CPU_KVCACHE_SPACE", "2"), **(env or {})})
        # A server collects its own workers' series (vllm_chunkattn/metrics.py), not
        # into the directory of this process, which may have loaded the plugin too.
        if METRICS_DIR_ENV not in (env or {}):
            self.env.pop(METRICS_DIR_ENV, None)
        self.process: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def command(self) -> list[str]:
        vllm = Path(sys.executable).with_name("vllm")
        return [str(vllm), "serve", self.model, "--host", "127.0.0.1", "--port", str(self.port), *self.args]

    def start(self) -> VllmServer:
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        log = open(self.log_path, "w")
        # A new session, so stop() can signal the whole process tree.
        self.process = subprocess.Popen(
            self.command(), stdout=log, stderr=subprocess.STDOUT, env=self.env, start_new_session=True
        )
        log.close()
        # A failed start, or Ctrl-C while waiting (then `with` never reaches
        # __exit__), must not leave engine processes behind.
        try:
            self._wait_healthy()
        except BaseException:
            self.stop()
            raise
        return self

    def _wait_healthy(self) -> None:
        deadline = time.monotonic() + self.startup_timeout_s
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise ServerError(
                    f"vllm serve exited with code {self.process.returncode} during startup; "
                    f"last lines of {self.log_path}:\n{self.log_tail()}"
                )
            if self.healthy():
                return
            time.sleep(1.0)
        raise ServerError(f"vllm serve was not healthy after {self.startup_timeout_s:.0f} s; see {self.log_path}")

    def healthy(self) -> bool:
        try:
            with urllib.request.urlopen(self.url + "/health", timeout=2) as r:
                return r.status == 200
        except (urllib.error.URLError, ConnectionError, TimeoutError, OSError):
            return False

    def stop(self, timeout_s: float = 30.0) -> None:
        if self.process is None:
            return
        # start_new_session: the group id is the leader's pid, valid even after
        # the leader exited (e.g. died during startup) while children live on.
        pgid = self.process.pid
        if self.process.poll() is None:
            try:
                os.killpg(pgid, signal.SIGINT)
                self.process.wait(timeout=timeout_s)
            except subprocess.TimeoutExpired:
                os.killpg(pgid, signal.SIGKILL)
                self.process.wait()
            except ProcessLookupError:
                pass
        # Engine-core and worker children can outlive the API server briefly.
        try:
            os.killpg(pgid, signal.SIGKILL)
        except ProcessLookupError:
            pass

    def log_tail(self, lines: int = 40) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return "(no log)"

    def log_text(self) -> str:
        return self.log_path.read_text(errors="replace")

    def __enter__(self) -> VllmServer:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
