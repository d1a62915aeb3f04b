"""A process that has started SGLang once (imported what ``python -m sglang.launch_server`` imports,
loaded the plugins) and forks the test servers and Engine scripts from there: each child takes its
request's environment, arguments, directory and log, and runs ``python -m MODULE`` or a script in
place, as does an ``exec`` of this Python inside it while it is still single-threaded. Only a
launch whose environment differs in ``LAUNCH_TIME_KEYS`` is forked (``Zygote.takes``);
``SGLANG_EMBEDS_TEST_ZYGOTE=0`` turns it off. A zygote of the ``client`` kind imports only the
client: the tutorials' kernels are forked from it (``notebook_kernels.py``). Why and what each
saves: docs/performance.md, "Servers forked from a started SGLang".
"""

from __future__ import annotations

import importlib
import json
import os
import runpy
import select
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from pathlib import Path
from typing import Any

# what `python -m sglang.launch_server` imports before `load_plugins()`, and after it
BEFORE_PLUGINS = ("sglang.srt.arg_groups.overrides", "sglang.srt.plugins", "sglang.srt.server_args",
                  "sglang.srt.utils", "sglang.srt.utils.common")
AFTER_PLUGINS = ("sglang.srt.entrypoints.http_server",)

# environment variables a launch may set apart from the zygote's: each is read after the fork
# (by `serve`'s plan, SGLang's launch or a request), never by an import or the plugins' load
LAUNCH_TIME_KEYS = frozenset({
    "PYTEST_CURRENT_TEST", "SGLANG_EMBEDS_CACHE", "SGLANG_UVICORN_WORKER_HEALTHCHECK_TIMEOUT",
    "SGLANG_CPU_OMP_THREADS_BIND",
})
SWITCH = "SGLANG_EMBEDS_TEST_ZYGOTE"


def enabled() -> bool:
    return os.environ.get(SWITCH, "1") != "0"


# ---- the zygote process ----------------------------------------------------------------------

def _os_threads() -> int:
    return len(os.listdir("/proc/self/task"))


def _preload() -> dict[str, str]:
    """Import and load as a launch does; return what that wrote into the environment."""
    before = dict(os.environ)
    for name in BEFORE_PLUGINS:
        importlib.import_module(name)
    from sglang.srt.plugins import load_plugins

    load_plugins()
    for name in AFTER_PLUGINS:
        importlib.import_module(name)
    return {k: v for k, v in os.environ.items() if before.get(k) != v}


# what a notebook's kernel imports before its first cell needs it (``import sgl_embeds`` is most
# of a kernel's start: SGLang's frontend, torch, transformers); nothing of the server side
CLIENT_PRELOAD = ("sgl_embeds", "sgl_embeds.vlm", "sgl_embeds.serve")


def _preload_client() -> dict[str, str]:
    for name in CLIENT_PRELOAD:
        importlib.import_module(name)
    return {}


PRELOADS = {"server": _preload, "client": _preload_client}


def _run_in_place(argv: list[str]) -> None:
    """``python ARGV``: ``-m MODULE ARGS...`` or ``SCRIPT ARGS...``, in this process."""
    if argv[0] == "-m":
        sys.argv = [argv[1], *argv[2:]]
        sys.path.insert(0, os.getcwd())  # as `python -m` puts it first
        sys.modules.pop(argv[1], None)  # imported already by some module: runpy would warn
        runpy.run_module(argv[1], run_name="__main__", alter_sys=True)
    else:
        sys.argv = list(argv)
        sys.path.insert(0, os.path.dirname(os.path.abspath(argv[0])))
        runpy.run_path(argv[0], run_name="__main__")


def _exec_in_place(threads_at_fork: int, real_execve: Any):
    def execve(path: str, args: list[str], env: dict[str, str]) -> None:
        args, threads = list(args), _os_threads()
        in_place = path == sys.executable and len(args) > 2 and args[1] == "-m" and threads <= threads_at_fork
        print(f"[zygote] exec {'in place' if in_place else 'for real'} ({threads} threads, "
              f"{threads_at_fork} at fork): {' '.join(args[1:3])}", file=sys.stderr, flush=True)
        if in_place:
            os.environ.clear()
            os.environ.update(env)
            _run_in_place(args[1:])
            _exit_as_python(0)
        real_execve(path, args, env)
    return execve


def _exit_as_python(code: int) -> None:
    """Leave as an interpreter does: non-daemon threads joined, atexit run, streams flushed."""
    try:
        threading._shutdown()  # type: ignore[attr-defined]
        import atexit
        atexit._run_exitfuncs()
    finally:
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except Exception:
                pass
        os._exit(code)


def _child(request: dict, written: dict[str, str], replies: Any) -> None:
    """The forked child: never returns to the zygote's loop."""
    try:
        _become(request, written, replies)
    except BaseException:  # failed before it ran anything (it exits itself otherwise)
        traceback.print_exc()
    finally:
        os._exit(1)


def _become(request: dict, written: dict[str, str], replies: Any) -> None:
    threads_at_fork = _os_threads()  # the zygote's other threads are not forked
    os.setsid()
    replies.close()
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)
    os.close(null)
    out = os.open(request["log"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
    err = os.open(request["err"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC) if request.get("err") else out
    os.dup2(out, 1)
    os.dup2(err, 2)  # one open file for both when they share a log: one offset, nothing overwritten
    for fd in {out, err}:
        os.close(fd)
    os.chdir(request["cwd"])
    os.environ.clear()
    os.environ.update({**request["env"], **written})
    if written:  # the plugins' load wrote these (a server zygote): said as their loader
        from sgl_embeds_srt.plugin import LOADED_BY_VAR

        if LOADED_BY_VAR in written:  # this process is the one that loaded the plugin, for its children
            os.environ[LOADED_BY_VAR] = str(os.getpid())
    if request.get("own_path_dropped") and _OWN_PATH in sys.path:
        sys.path.remove(_OWN_PATH)  # the zygote's folder (`python -m` put it first): not the child's
    import numpy  # (Python's random reseeds itself after a fork; numpy's global state does not)

    numpy.random.seed()  # from the OS, as a fresh interpreter does
    os.execve = _exec_in_place(threads_at_fork, os.execve)
    code = 0
    try:
        _run_in_place(request["argv"])
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
        if not isinstance(e.code, (int, type(None))):
            print(e.code, file=sys.stderr)
    except BaseException:
        traceback.print_exc()
        code = 1
    _exit_as_python(code)


def _reap(status_dir: Path, children: set[int]) -> None:
    while children:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return
        children.discard(pid)
        code = os.waitstatus_to_exitcode(status)
        tmp = status_dir / f".{pid}"
        tmp.write_text(str(code))
        tmp.rename(status_dir / str(pid))


_OWN_PATH = sys.path[0]


def serve_forever(status_dir: Path, kind: str = "server") -> None:
    """Read launch requests (a JSON line each) on stdin, answer each with the child's pid on
    stdout; write each child's exit code to STATUS_DIR/PID. At the end of stdin, stop them all."""
    replies = os.fdopen(os.dup(1), "w")  # the answers' pipe; what anything prints goes to the log
    os.dup2(2, 1)
    written = PRELOADS[kind]()
    children: set[int] = set()
    print(json.dumps({"ready": True}), file=replies, flush=True)
    try:
        while True:
            readable, _, _ = select.select([sys.stdin], [], [], 0.1)
            _reap(status_dir, children)
            if not readable:
                continue
            line = sys.stdin.readline()
            if not line:
                break
            request = json.loads(line)
            sys.stdout.flush()
            sys.stderr.flush()
            pid = os.fork()
            if pid == 0:
                _child(request, written, replies)
            children.add(pid)
            print(json.dumps({"pid": pid}), file=replies, flush=True)
    finally:
        for pid in children:
            try:
                os.killpg(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass


# ---- the test process's side -----------------------------------------------------------------

class Forked:
    """A child of the zygote, by pid; its exit code comes from the zygote's status file."""

    def __init__(self, pid: int, status: Path, args: list[str]):
        self.pid = pid
        self.args = args
        self.returncode: int | None = None
        self.stdin = self.stdout = self.stderr = None  # as a Popen without pipes (jupyter_client reads them)
        self._status = status

    def poll(self) -> int | None:
        if self.returncode is None and self._status.exists():
            self.returncode = int(self._status.read_text())
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.poll() is None:
            if deadline is not None and time.monotonic() > deadline:
                raise subprocess.TimeoutExpired(self.args, timeout)
            time.sleep(0.05)
        return self.returncode

    def send_signal(self, sig: int) -> None:
        if self.poll() is None:
            try:
                os.kill(self.pid, sig)
            except ProcessLookupError:
                pass

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


class ZygoteError(RuntimeError):
    pass


class Zygote:
    """The test process's handle on one zygote, started with environment ``env``: of ``kind``
    (``PRELOADS``), forking launches whose environment differs from ``env`` in ``free_keys`` only."""

    def __init__(self, env: dict[str, str], kind: str = "server", free_keys: frozenset[str] = LAUNCH_TIME_KEYS):
        self.env, self.kind, self.free_keys = dict(env), kind, free_keys
        self._status_dir = Path(tempfile.mkdtemp(prefix="sgl-embeds-zygote-"))
        self._log = open(self._status_dir / "zygote.log", "wb")
        self._proc = subprocess.Popen([sys.executable, "-m", __name__, str(self._status_dir), kind],
                                      stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self._log,
                                      env=self.env, text=True, bufsize=1)
        self._lock = threading.Lock()
        self._ready = False

    def takes(self, env: dict[str, str]) -> bool:
        """Whether a launch with environment ``env`` may be forked from this zygote."""
        keys = set(env) | set(self.env)
        return self.alive() and all(env.get(k) == self.env.get(k) for k in keys - self.free_keys)

    def alive(self) -> bool:
        return self._proc.poll() is None

    @property
    def folder(self) -> Path:
        """Its own temporary folder (its log, its children's exit codes), removed by ``stop``."""
        return self._status_dir

    def _reply(self) -> dict:
        line = self._proc.stdout.readline()
        if not line:
            raise ZygoteError(f"the zygote exited:\n{Path(self._log.name).read_text(errors='replace')[-3000:]}")
        return json.loads(line)

    def spawn(self, argv: list[str], env: dict[str, str], log_path: Path, cwd: str | None = None,
              err_path: Path | None = None) -> Forked:
        """``sys.executable ARGV`` (``-m MODULE ...`` or a script), forked; its output to
        ``log_path`` (its stderr to ``err_path`` if given)."""
        request = {"argv": argv, "env": env, "log": str(log_path), "cwd": cwd or os.getcwd(),
                   "err": str(err_path) if err_path else None, "own_path_dropped": self.kind == "client"}
        with self._lock:
            if not self._ready:
                self._ready = self._reply()["ready"]
            self._proc.stdin.write(json.dumps(request) + "\n")
            self._proc.stdin.flush()
            pid = self._reply()["pid"]
        return Forked(pid, self._status_dir / str(pid), [sys.executable, *argv])

    def stop(self) -> None:
        """Close its stdin: it kills what it still runs and exits."""
        if self.alive():
            self._proc.stdin.close()
            try:
                self._proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self._proc.kill()
        self._log.close()
        shutil.rmtree(self._status_dir, ignore_errors=True)


def run(argv: list[str], env: dict[str, str], timeout: float) -> subprocess.CompletedProcess:
    """``subprocess.run([sys.executable, *argv], capture_output=True, text=True)``, forked from the
    shared zygote where it takes ``env``."""
    forker = shared(env)
    with tempfile.TemporaryDirectory() as tmp:
        out, err = Path(tmp, "stdout"), Path(tmp, "stderr")
        child = spawn_or_none(forker, argv, env, out, err_path=err)
        if child is None:
            return subprocess.run([sys.executable, *argv], capture_output=True, text=True, env=env, timeout=timeout)
        try:
            code = child.wait(timeout)
        except subprocess.TimeoutExpired:
            os.killpg(child.pid, signal.SIGKILL)  # and what it started
            child.wait()
            raise
        return subprocess.CompletedProcess(child.args, code, out.read_text(errors="replace"),
                                           err.read_text(errors="replace"))


def spawn_or_none(forker: Zygote | None, argv: list[str], env: dict[str, str], log_path: Path,
                  err_path: Path | None = None, cwd: str | None = None) -> Forked | None:
    """``forker.spawn(...)`` where it takes ``env``; None where it does not or has died (said on
    stderr): the caller starts a fresh interpreter."""
    if forker is None or not forker.takes(env):
        return None
    try:
        return forker.spawn(argv, env, log_path, cwd=cwd, err_path=err_path)
    except ZygoteError as e:
        print(f"[zygote] launching fresh interpreters from now on: {e}", file=sys.stderr)
        return None


class Shared:
    """One zygote of a ``kind`` per test run, started at the first ``get`` with that call's
    environment; ``get`` gives None when turned off or when it has died (it would again)."""

    def __init__(self, kind: str = "server", free_keys: frozenset[str] = LAUNCH_TIME_KEYS):
        self.kind, self.free_keys = kind, free_keys
        self._zygote: Zygote | None = None
        self._lock = threading.Lock()

    def get(self, env: dict[str, str]) -> Zygote | None:
        if not enabled():
            return None
        with self._lock:
            if self._zygote is None:
                self._zygote = Zygote(env, self.kind, self.free_keys)
            return self._zygote if self._zygote.alive() else None

    def stop(self) -> None:
        with self._lock:
            if self._zygote is not None:
                self._zygote.stop()
                self._zygote = None


_servers = Shared()  # the test servers' and Engine scripts'


def shared(env: dict[str, str]) -> Zygote | None:
    """The test run's server zygote (``Shared.get``)."""
    return _servers.get(env)


def stop_shared() -> None:
    _servers.stop()


if __name__ == "__main__":
    serve_forever(Path(sys.argv[1]), *sys.argv[2:])
