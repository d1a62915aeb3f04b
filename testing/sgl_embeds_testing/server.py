"""Start and stop real SGLang servers (and in-process Engines) with the CPU launch defaults.

The CPU launch flags are ``sgl_embeds.serve``'s (``--sleep-on-idle``: without it the idle
scheduler busy-loops a core and starves a 2-core machine; torch-native attention, no CUDA graph,
no overlap schedule, float32); here they are joined by a thread count per process that leaves the
cores to the model. A ``Server`` launches ``python -m sglang.launch_server`` itself, or with
``via_serve`` the user's command, ``python -m sgl_embeds serve CHECKPOINT``.
"""

from __future__ import annotations

import concurrent.futures
import os
import random
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import requests
import sglang as sgl

from sgl_embeds_testing import zygote
from sgl_embeds.serve import CPU_ENV, CPU_KV_TOKENS, cpu_launch_args, on_cpu  # noqa: F401 (re-exported)

READY_TIMEOUT_S = 240.0
DRAIN_S = 30.0  # how long a stopping server may drain before it is killed


def cpu_env(threads: int | None = None) -> dict[str, str]:
    env = dict(os.environ)
    env.update(CPU_ENV, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1")
    n = str(threads or os.cpu_count() or 1)
    env.setdefault("OMP_NUM_THREADS", n)
    env.setdefault("MKL_NUM_THREADS", n)
    return env


def default_launch_args(dtype: str = "float32") -> list[str]:
    return cpu_launch_args(dtype) if on_cpu() else ["--dtype", dtype]


# Ports for our servers, gateways and event sockets: below SGLang's own (22000-29999, for its
# schedulers' process groups) with room for the ports a server derives from its own (+233..+239),
# and below the kernel's ephemeral range (32768+), from which every outgoing connection takes its
# local port: one of those holding a server's port while the pool has it stopped would make its
# restart on that port fail ("address already in use").
PORT_RANGE = (10000, 21700)


def free_port() -> int:
    """A port on 127.0.0.1 nobody has bound, from ``PORT_RANGE``."""
    for port in random.sample(range(*PORT_RANGE), 64):
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    raise ServerStartError(f"no free port in {PORT_RANGE} after 64 tries")


def port_in_use(port: int) -> bool:
    with socket.socket() as s:
        return s.connect_ex(("127.0.0.1", port)) == 0


class ServerStartError(RuntimeError):
    pass


@dataclass
class Server:
    """A ``python -m sglang.launch_server`` child on 127.0.0.1, stopped by its own pid."""

    model_dir: Path
    extra_args: list[str] = field(default_factory=list)
    port: int = 0
    dtype: str = "float32"
    log_path: Path | None = None
    env: dict[str, str] = field(default_factory=dict)
    proc: subprocess.Popen | zygote.Forked | None = None
    # launched by `python -m sgl_embeds serve model_dir` (a checkpoint: it picks the flags)
    via_serve: bool = False

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self, timeout: float = READY_TIMEOUT_S) -> "Server":
        self.launch()
        return self.wait_ready(timeout)

    def launch(self) -> "Server":
        """Start the server process, without waiting for it to be ready (``wait_ready``)."""
        if not Path(self.model_dir, "config.json").exists():
            raise ServerStartError(f"model dir {self.model_dir} has no config.json")
        self.port = self.port or free_port()
        if port_in_use(self.port):
            raise ServerStartError(f"port {self.port} on 127.0.0.1 is already in use")
        if self.log_path is None:
            fd, name = tempfile.mkstemp(prefix=f"sglang-{self.port}-", suffix=".log")
            os.close(fd)
            self.log_path = Path(name)
        address = ["--host", "127.0.0.1", "--port", str(self.port)]
        if self.via_serve:
            cmd = [sys.executable, "-m", "sgl_embeds", "serve", str(self.model_dir), *address,
                   *self.extra_args]
        else:
            cmd = [sys.executable, "-m", "sglang.launch_server", "--model-path", str(self.model_dir),
                   *address, *default_launch_args(self.dtype), *self.extra_args]
        base = cpu_env()
        env = {**base, **self.env}
        self.proc = zygote.spawn_or_none(zygote.shared(base), cmd[1:], env, self.log_path)
        if self.proc is not None:
            return self
        log = open(self.log_path, "wb")
        self.proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
        log.close()
        return self

    def wait_ready(self, timeout: float = READY_TIMEOUT_S) -> "Server":
        """Wait until the launched server answers; stopped if it does not (``ServerStartError``)."""
        try:
            self._wait_ready(timeout)
        except BaseException:  # a timeout, a dead server, or Ctrl-C: never leave it running
            self.stop()
            raise
        return self

    def _wait_ready(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise ServerStartError(f"server exited with code {self.proc.returncode} during startup\n{self.log_tail()}")
            # the log's line, then any answer over HTTP (a keyed server's is a 401): SGLang's
            # /health answers after a 1 s probe of the scheduler, a second per poll
            try:
                if self._fired_up() and requests.get(self.url + "/model_info", timeout=2).status_code < 500:
                    return
            except requests.RequestException:
                pass
            time.sleep(0.25)
        raise ServerStartError(f"server not ready after {timeout:.0f} s\n{self.log_tail()}")

    def _fired_up(self) -> bool:
        return "fired up and ready to roll" in self.log_path.read_text(errors="replace")

    def log_tail(self, lines: int = 40) -> str:
        if self.log_path is None or not self.log_path.exists():
            return "(no log)"
        tail = self.log_path.read_text(errors="replace").splitlines()[-lines:]
        return f"--- last {len(tail)} lines of {self.log_path} ---\n" + "\n".join(tail)

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def stop(self, drain: float = DRAIN_S) -> None:
        """Stop the server's whole process group (its scheduler/detokenizer children too), killed
        if it has not drained within ``drain`` seconds."""
        if self._ask_to_stop():
            self._wait_stopped(drain)

    def _ask_to_stop(self) -> bool:
        """SIGTERM, if it is running: the server drains (~5 s) and stops its own children."""
        if self.proc is None or self.proc.poll() is not None:
            return False
        self.proc.send_signal(signal.SIGTERM)
        return True

    def _wait_stopped(self, timeout: float = DRAIN_S) -> None:
        try:
            self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(timeout=10)
        try:  # anything of its session that outlived it (start_new_session: its group id is its pid)
            os.killpg(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass

    def __enter__(self) -> "Server":
        return self.start()

    def __exit__(self, *exc: Any) -> None:
        self.stop()

    def generate(self, body: dict, timeout: float = 120) -> requests.Response:
        return requests.post(self.url + "/generate", json=body, timeout=timeout)


def start_each(servers: list[Server], timeout: float = READY_TIMEOUT_S,
               launched: list[bool] | None = None) -> list[BaseException | None]:
    """Start several servers at once (their startups overlap; ``launched``: which ones were
    launched already, to wait for): each one's error, or None."""
    launched = launched or [False] * len(servers)
    with concurrent.futures.ThreadPoolExecutor(len(servers)) as pool:
        futures = [pool.submit(s.wait_ready if done else s.start, timeout) for s, done in zip(servers, launched)]
        return [f.exception() for f in futures]


def start_all(servers: list[Server], timeout: float = READY_TIMEOUT_S) -> list[Server]:
    """Start several servers at once; all stopped if one fails."""
    errors = start_each(servers, timeout)
    if any(errors):
        stop_all(servers)
        raise next(e for e in errors if e)
    return servers


def stop_all(servers: list[Server]) -> None:
    """Stop several servers at once: each drains for a few seconds, so they drain together."""
    for s in [s for s in servers if s._ask_to_stop()]:
        s._wait_stopped()


class ServerPool:
    """Servers by name, started when first asked for and kept for later tests, at most
    ``max_running`` at a time (each SGLang server holds ~2 GB and some CPU even when idle); to
    make room, the idle one needed again last (``next_use``, where known; else the least recently
    used) stops first.

    ``get`` starts the ones of its names not running, together (their startups overlap), after
    stopping idle ones (that no part of the current test asked for: ``begin_test`` starts a
    test) to make room. ``prefetch`` launches a server a later test will ask for without waiting for
    it, so its startup (mostly one core importing SGLang) overlaps the tests before that one; its
    ``get`` then only waits for it. A server stopped to make room is not waited for (SGLang drains
    for ~6 s, idle): it stops beside what runs next and is reaped later, at the latest before it
    starts again. A stopped server keeps its object and port and restarts in
    place when asked for again, so URLs handed out earlier stay good. A server that failed to
    start fails every later ``get`` at once, rather than spending another start timeout per test.
    ``makers`` builds each named ``Server`` (unstarted) when it is first asked for."""

    def __init__(self, makers: dict[str, Callable[[], Server]], max_running: int | None = None):
        self.makers = makers
        self.max_running = max_running
        self.made: dict[str, Server] = {}
        self.running: dict[str, Server] = {}  # least recently used first
        self.launched: dict[str, Server] = {}  # prefetched: started, not yet known to be ready
        self.failed: dict[str, BaseException] = {}
        self.stopping: dict[str, float] = {}  # asked to stop (SIGTERM), not yet reaped: since when
        self.in_use: set[str] = set()  # asked for by the current test: never stopped to make room
        # per name: how often it was launched, and how long tests waited in ``get`` for it to be
        # ready (a prefetched start that finished in time costs no wait): ``start_report``
        self.starts: dict[str, int] = {}
        self.waited_s: dict[str, float] = {}
        # where known, when each server is next needed (a larger number: later; the test run's
        # order): the one needed last is stopped first, else the least recently used
        self.next_use: Callable[[str], float] | None = None

    def _stop_order(self, idle: list[str]) -> list[str]:
        """``idle`` servers in the order to stop them to make room."""
        if self.next_use is None:
            return idle
        return sorted(idle, key=self.next_use, reverse=True)

    def begin_test(self) -> None:
        self.in_use = set()
        self._reap()

    def _server(self, name: str) -> Server:
        """The named server, about to be launched: still stopping from an earlier stop, it is
        waited for first (its port)."""
        if name not in self.made:
            self.made[name] = self.makers[name]()
        if self.stopping.pop(name, None) is not None:
            self.made[name]._wait_stopped()
        return self.made[name]

    def _retire(self, names: list[str]) -> None:
        """Stop these running servers without waiting for them (``_reap``)."""
        for name in names:
            server = self.running.pop(name)
            if server._ask_to_stop():
                self.stopping[name] = time.monotonic()

    def _reap(self, wait: bool = False) -> None:
        """Finish the stops that are done (all, with ``wait``; one draining past
        ``DRAIN_S`` is killed, as ``Server.stop`` would)."""
        for name, since in list(self.stopping.items()):
            overdue = time.monotonic() - since > DRAIN_S
            if wait or overdue or not self.made[name].alive():
                del self.stopping[name]
                self.made[name]._wait_stopped(timeout=0 if overdue else DRAIN_S)

    def get(self, *names: str) -> list[Server]:
        self.in_use.update(names)
        for name in names:
            if name in self.failed:
                raise ServerStartError(f"server {name!r} failed to start earlier in this session") from self.failed[name]
        prefetched = [name for name in names if name in self.launched]
        missing = [name for name in names if name not in self.running and name not in self.launched]
        if missing:
            self.make_room(len(missing))
        waiting = prefetched + missing
        if waiting:
            servers = [self._server(name) for name in waiting]
            for name in prefetched:
                del self.launched[name]
            for name in missing:
                self.starts[name] = self.starts.get(name, 0) + 1
            began = time.monotonic()
            errors = start_each(servers, launched=[name in prefetched for name in waiting])
            for name in waiting:
                self.waited_s[name] = self.waited_s.get(name, 0.0) + time.monotonic() - began
            if any(errors):
                stop_all(servers)
                self.failed.update((name, e) for name, e in zip(waiting, errors) if e)
                raise next(e for e in errors if e)
            self.running.update(zip(waiting, servers))
        for name in names:  # now the most recently used
            self.running[name] = self.running.pop(name)
        return [self.running[name] for name in names]

    def prefetch(self, name: str, keep: set[str]) -> bool:
        """Launch ``name`` now for a later test, if there is room without stopping a server in
        ``keep`` (those the tests until then ask for) or the current test's; True if launched."""
        if name in self.running or name in self.launched or name in self.failed:
            return False
        if self.max_running is not None:
            idle = self._stop_order([n for n in self.running if n not in self.in_use and n not in keep])
            excess = len(self.running) + len(self.launched) + 1 - self.max_running
            if excess > len(idle):
                return False
            self._retire(idle[:max(excess, 0)])
        try:
            self.launched[name] = self._server(name).launch()
            self.starts[name] = self.starts.get(name, 0) + 1
        except ServerStartError as e:
            self.failed[name] = e
            return False
        return True

    def make_room(self, count: int) -> None:
        """Stop the least recently used servers the current test did not ask for until ``count``
        more fit under ``max_running`` (for servers of the pool, or a test's own)."""
        if self.max_running is None:
            return
        idle = self._stop_order([name for name in self.running if name not in self.in_use])
        excess = len(self.running) + len(self.launched) + count - self.max_running
        self._retire(idle[:max(excess, 0)])

    def start_report(self) -> list[str]:
        """One line per server started: its launches and the seconds tests waited for it."""
        names = sorted(self.starts, key=lambda name: -self.waited_s.get(name, 0.0))
        total = sum(self.waited_s.values())
        return [f"{name:<16} {self.starts[name]} launch(es), {self.waited_s.get(name, 0.0):6.1f} s waited"
                for name in names] + [f"{'all':<16} {sum(self.starts.values())} launch(es), {total:6.1f} s waited"]

    def stop(self) -> None:
        stop_all([*self.running.values(), *self.launched.values()])
        self._reap(wait=True)
        self.running.clear()
        self.launched.clear()


def smg_binary() -> str:
    """The gateway's binary, installed into this environment by scripts/setup.sh."""
    path = Path(sys.executable).parent / "smg"
    if not path.exists():
        raise ServerStartError(f"no smg at {path}: run `make setup` (requirements/dev.txt pins it)")
    return str(path)


@dataclass
class Gateway:
    """SGLang's model gateway (``smg launch``) on 127.0.0.1 in front of ``worker_urls``, stopped by
    its own pid. ``args``: the launch flags after the workers (policy, retries, breaker)."""

    worker_urls: list[str]
    args: list[str] = field(default_factory=lambda: ["--policy", "cache_aware"])
    port: int = 0
    log_path: Path | None = None
    proc: subprocess.Popen | None = None
    workers: list[Server] = field(default_factory=list)  # set by whoever started them
    metrics_port: int = 0  # its Prometheus metrics, on 127.0.0.1

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self, timeout: float = 60.0) -> "Gateway":
        self.port = self.port or free_port()
        self.metrics_port = self.metrics_port or free_port()
        fd, name = tempfile.mkstemp(prefix=f"smg-{self.port}-", suffix=".log")
        os.close(fd)
        self.log_path = Path(name)
        # its metrics server would bind 0.0.0.0:29000 by default: loopback, on a free port. No
        # grace period at shutdown: it is stopped after its tests, nothing in flight, and would
        # otherwise take 5 s to stop
        cmd = [smg_binary(), "launch", "--host", "127.0.0.1", "--port", str(self.port),
               "--prometheus-host", "127.0.0.1", "--prometheus-port", str(self.metrics_port),
               "--shutdown-grace-period-secs", "0",
               "--worker-urls", *self.worker_urls, *self.args]
        with open(self.log_path, "wb") as log:
            self.proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise ServerStartError(f"smg exited with code {self.proc.returncode}\n{self.log_path.read_text(errors='replace')[-3000:]}")
            if len(self.healthy_workers()) == len(self.worker_urls):
                return self
            time.sleep(0.3)
        self.stop()
        raise ServerStartError(f"smg did not see {len(self.worker_urls)} healthy workers in {timeout:.0f} s")

    @property
    def admin_headers(self) -> dict[str, str]:
        """What its own routes (``/workers``) need: with keys (``--api-key``, ``--tenant-api-key``)
        smg authenticates every caller, so the shared key when it has one."""
        if "--api-key" not in self.args:
            return {}
        return {"Authorization": f"Bearer {self.args[self.args.index('--api-key') + 1]}"}

    def healthy_workers(self) -> list[str]:
        """URLs of the workers the gateway routes to now."""
        try:
            workers = requests.get(self.url + "/workers", headers=self.admin_headers,
                                   timeout=2).json()["workers"]
        except (requests.RequestException, ValueError, KeyError):
            return []
        return [w["url"] for w in workers if w.get("is_healthy")]

    def posts_taken(self, path: str) -> int:
        """How many POST requests to ``path`` the gateway has taken (its Prometheus counter)."""
        metrics = requests.get(f"http://127.0.0.1:{self.metrics_port}/metrics", timeout=10).text
        line = f'smg_http_requests_total{{method="POST",path="{path}"}} '
        return sum(int(float(m[len(line):])) for m in metrics.splitlines() if m.startswith(line))

    def stop(self) -> None:
        if self.proc is None or self.proc.poll() is not None:
            return
        self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(timeout=10)


def engine(model_dir: Path, dtype: str = "float32", **kwargs: Any) -> Any:
    """An in-process ``sglang.Engine`` with the same launch defaults; on CPU this process and the
    ones the Engine starts run with the CPU kernels on."""
    os.environ.update({k: v for k, v in cpu_env().items()
                       if k.startswith(("SGLANG_", "HF_", "TRANSFORMERS_"))})
    opts: dict[str, Any] = dict(model_path=str(model_dir), dtype=dtype, log_level="error")
    if on_cpu():
        from sgl_embeds_cpu import plugin  # SGLang may have resolved its platform here before the opt-in

        plugin.turn_on()
        opts.update(device="cpu", attention_backend="torch_native", disable_cuda_graph=True,
                    disable_overlap_schedule=True, sleep_on_idle=True, max_total_tokens=CPU_KV_TOKENS)
    opts.update(kwargs)
    return sgl.Engine(**opts)
