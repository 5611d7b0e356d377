"""A running system: its server and client processes, driven over the line protocol.

``Pair.start`` launches the server (reads its READY line for the address), then the client;
``run(n)`` asks the client for ``n`` timed rounds. A placement puts a command prefix in front
of each process (``ip netns exec NS`` for the two-namespace placement).
"""

from __future__ import annotations

import contextlib
import itertools
import json
import os
import queue
import secrets
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

from tensorx._ps.common.abtimer import PROBE, SKIP

ROOT = Path(__file__).resolve().parents[2]
PYTHON = sys.executable
START_TIMEOUT = 120.0
# tensorx refuses to listen beyond loopback without a shared secret: one per benchmark run.
TOKEN = secrets.token_hex(16)
NETWORK_ONLY = "TX_BENCH_NETWORK_ONLY"  # set: systems use only what works between hosts
UCX_TCP = "TENSORX_UCX_TCP"  # see Pair._defaults_env


class BenchError(RuntimeError):
    """A benchmark process failed; the message carries the tail of its log."""


@dataclass(frozen=True)
class Placement:
    name: str
    server_host: str
    server_prefix: tuple[str, ...] = ()
    client_prefix: tuple[str, ...] = ()
    server_env: dict[str, str] = field(default_factory=dict)
    client_env: dict[str, str] = field(default_factory=dict)


SAME_HOST = Placement("same host", "127.0.0.1")


@dataclass(frozen=True)
class System:
    """One column of the comparison: a launch.py system plus its options."""

    label: str
    system: str
    options: tuple[str, ...] = ()


class _Proc:
    """A child process whose stdout lines arrive on a queue (stderr goes to a log file)."""

    def __init__(self, cmd: list[str], log: Path, env: dict[str, str]) -> None:
        self.log = log
        self._log_file = log.open("ab")
        self.popen = subprocess.Popen(cmd, cwd=ROOT, stdin=subprocess.PIPE,
                                      stdout=subprocess.PIPE, stderr=self._log_file,
                                      env={**os.environ, "TENSORX_TOKEN": TOKEN, **env},
                                      text=True, bufsize=1)
        self.lines: queue.Queue[str | None] = queue.Queue()
        threading.Thread(target=self._pump, args=(self.popen.stdout,), daemon=True).start()

    def _pump(self, stream: IO[str] | None) -> None:
        assert stream is not None
        for line in stream:
            self.lines.put(line.rstrip("\n"))
        self.lines.put(None)

    def expect(self, prefix: str, timeout: float) -> str:
        deadline = time.monotonic() + timeout
        while True:
            try:
                line = self.lines.get(timeout=max(0.01, deadline - time.monotonic()))
            except queue.Empty:
                raise BenchError(f"no {prefix} within {timeout:.0f} s{self.tail()}") from None
            if line is None:
                raise BenchError(f"process exited (rc={self.popen.wait()}) before "
                                 f"{prefix}{self.tail()}")
            if line.startswith(prefix + " "):
                return line[len(prefix) + 1:]

    def send(self, line: str) -> None:
        assert self.popen.stdin is not None
        self.popen.stdin.write(line + "\n")
        self.popen.stdin.flush()

    def tail(self, n: int = 25) -> str:
        self._log_file.flush()
        lines = self.log.read_text(errors="replace").splitlines()[-n:]
        return "\n  log " + str(self.log) + ":\n    " + "\n    ".join(lines) if lines else ""

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 20.0) -> None:
        if self.popen.poll() is None:
            self.popen.send_signal(sig)
            try:
                self.popen.wait(timeout)
            except subprocess.TimeoutExpired:
                self.popen.kill()
                self.popen.wait(10)
        self._log_file.close()


class Pair:
    """A system's server and client processes for one model and placement (``clients``
    workers, ``--rank`` 0.. each; a round's time is the slowest worker's)."""

    def __init__(self, system: System, model: str, placement: Placement, logdir: Path,
                 clients: int = 1, start_timeout: float = START_TIMEOUT) -> None:
        self.system = system
        self.start_timeout = start_timeout
        self.clients = clients
        self.model = model
        self.placement = placement
        self.logdir = logdir
        self.info: dict[str, Any] = {}
        self._server: _Proc | None = None
        self._clients: list[_Proc] = []

    def _cmd(self, role: str, prefix: tuple[str, ...], extra: list[str]) -> list[str]:
        return [*prefix, PYTHON, "-m", "benchmarks.baselines.launch", self.system.system, role,
                "--model", self.model, "--host", self.placement.server_host,
                *self.system.options, *extra]

    def _log(self, role: str) -> Path:
        slug = "".join(c if c.isalnum() else "-" for c in
                       f"{self.placement.name}-{self.system.label}-{self.model}-{role}")
        return self.logdir / f"{slug}.log"

    def _defaults_env(self) -> dict[str, str]:
        """A system on ``transport="auto"`` measures what users get: ``make bench`` allows
        UCX's tcp (TENSORX_UCX_TCP=1) for the UCX rows, which a default node leaves out,
        and across hosts ``auto`` would then pick it."""
        opts = self.system.options
        auto = any(a == "--transport" and b == "auto" for a, b in itertools.pairwise(opts))
        return {UCX_TCP: "0"} if auto else {}

    def start(self) -> Pair:
        self.logdir.mkdir(parents=True, exist_ok=True)
        self._server = _Proc(self._cmd("server", self.placement.server_prefix, []),
                             self._log("server"), {**self.placement.server_env,
                                                   **self._defaults_env()})
        ready = json.loads(self._server.expect("READY", self.start_timeout))
        extra = ["--port", str(ready.get("port", 0)), "--address", ready.get("address", "")]
        self._clients = [_Proc(self._cmd("client", self.placement.client_prefix,
                                         [*extra, "--rank", str(r)]),
                               self._log(f"client{r}"), {**self.placement.client_env,
                                                         **self._defaults_env()})
                         for r in range(self.clients)]
        infos = [json.loads(c.expect("READY", self.start_timeout)) for c in self._clients]
        self.info = infos[0]
        return self

    def run(self, rounds: int, timeout: float = 300.0) -> list[float]:
        for c in self._clients:
            c.send(f"run {rounds}")
        times = [json.loads(c.expect("TIMES", timeout)) for c in self._clients]
        return [max(ts) for ts in zip(*times, strict=True)]

    def kill(self) -> None:
        """After a failure: SIGKILL every process of the pair now (no graceful waits)."""
        for proc in [*self._clients, *([self._server] if self._server else [])]:
            if proc.popen.poll() is None:
                proc.popen.kill()
        self.close()

    def close(self) -> None:
        clients, server = self._clients, self._server
        self._clients, self._server = [], None
        for client in clients:  # all first: a graceful rpc.shutdown waits for every worker
            if client.popen.poll() is None:
                with contextlib.suppress(OSError):
                    client.send("quit")
        for client in clients:
            with contextlib.suppress(subprocess.TimeoutExpired):
                client.popen.wait(30)
            client.stop()
        if server is not None:
            server.stop()


# Unmeasured rounds each system runs before its measured blocks (beyond the 2 every
# baseline client runs before READY): a tensorx shard and worker probe their choices (a
# pipelined round's early apply, a worker's gradient overlap) over their first rounds,
# 2 + 2 x 4 of them (tensorx._ps.common.abtimer), then keep the faster way for the next 500; a
# long training run pays that once, so the measured rounds start after it.
WARMUP_ROUNDS = SKIP + 2 * PROBE + 2


def warm_up(pairs: dict[str, Pair], rounds: int = WARMUP_ROUNDS) -> None:
    """``rounds`` unmeasured rounds of each pair, one pair after the other: each probes
    alone, as its measured blocks run (started together, they would probe under each
    other's start-up load and might keep the wrong way)."""
    for pair in pairs.values():
        pair.run(rounds)
