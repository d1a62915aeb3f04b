"""The test servers' pool: each server starts once, those asked for together start together, all
are asked to stop before any is waited for, and one stopped to make room is not waited for until
it is done, overdue or about to start again (no processes: the servers here only record)."""

from __future__ import annotations

import threading

import pytest

from sgl_embeds_testing.server import DRAIN_S, Server, ServerPool, ServerStartError


class RecordingServer(Server):
    """Records start / stop calls; ``start`` waits at ``barrier`` so overlapping starts are seen."""

    def __init__(self, name: str, log: list, barrier: threading.Barrier | None = None, fails: bool = False):
        super().__init__(model_dir=name)
        self.name, self.log, self.barrier, self.fails = name, log, barrier, fails
        self.draining = False  # asked to stop and still running (``alive``)
        self.wait_timeouts: list[float] = []

    def start(self, timeout: float = 0) -> "RecordingServer":
        self.log.append(("start", self.name))
        if self.barrier is not None:
            self.barrier.wait()  # raises BrokenBarrierError unless the other start runs meanwhile
        if self.fails:
            raise ServerStartError(f"{self.name} failed")
        return self

    def launch(self) -> "RecordingServer":
        self.log.append(("launch", self.name))
        return self

    def wait_ready(self, timeout: float = 0) -> "RecordingServer":
        self.log.append(("ready", self.name))
        return self

    def _ask_to_stop(self) -> bool:
        self.log.append(("ask", self.name))
        return True

    def alive(self) -> bool:
        return self.draining

    def _wait_stopped(self, timeout: float = DRAIN_S) -> None:
        self.log.append(("wait", self.name))
        self.wait_timeouts.append(timeout)


def test_servers_asked_for_together_start_together_once_and_stop_together():
    log: list = []
    together = threading.Barrier(2, timeout=5)
    pool = ServerPool({name: (lambda name=name: RecordingServer(name, log, together)) for name in "ab"}
                      | {"c": lambda: RecordingServer("c", log)})
    a, b = pool.get("a", "b")
    assert (a.name, b.name) == ("a", "b") and sorted(log) == [("start", "a"), ("start", "b")]
    assert pool.get("b", "c")[0] is b and log[2:] == [("start", "c")]  # b is not started again
    log.clear()
    pool.stop()
    assert log == [("ask", "a"), ("ask", "b"), ("ask", "c"), ("wait", "a"), ("wait", "b"), ("wait", "c")]
    assert pool.running == {}


def test_a_failed_start_stops_the_servers_started_with_it():
    log: list = []
    both = threading.Barrier(2, timeout=5)
    pool = ServerPool({"ok": lambda: RecordingServer("ok", log, both), "bad": lambda: RecordingServer("bad", log, both, fails=True)})
    with pytest.raises(ServerStartError, match="bad failed"):
        pool.get("ok", "bad")
    assert ("ask", "ok") in log and ("wait", "ok") in log and pool.running == {}


def test_at_most_max_running_run_and_the_least_recently_used_idle_one_stops_first():
    log: list = []
    pool = ServerPool({name: (lambda name=name: RecordingServer(name, log)) for name in "abcd"}, max_running=2)
    a, _ = pool.get("a", "b")
    pool.begin_test()
    pool.get("a")  # a is now more recently used than b
    pool.begin_test()
    log.clear()
    pool.get("c")
    # b is asked to stop and not waited for: c starts while b drains; the next test reaps b
    assert log == [("ask", "b"), ("start", "c")] and list(pool.running) == ["a", "c"] and list(pool.stopping) == ["b"]
    pool.begin_test()
    assert log[-1] == ("wait", "b") and pool.stopping == {}
    log.clear()
    assert pool.get("a")[0] is a and log == []  # running: not started again
    pool.begin_test()
    pool.get("b")  # b restarts as the same object (same port), c stops for it
    assert pool.made["b"] is pool.running["b"] and list(pool.running) == ["a", "b"]


def test_where_the_next_uses_are_known_the_idle_server_needed_last_stops_first():
    log: list = []
    pool = ServerPool({name: (lambda name=name: RecordingServer(name, log)) for name in "abcd"}, max_running=3)
    pool.get("a", "b", "c")
    pool.next_use = {"a": 5, "b": float("inf"), "c": 9}.get  # b: never again; then c, then a
    pool.begin_test()
    pool.get("a")  # a is the most recently used: the least recently used would be b anyway
    pool.next_use = {"a": 5, "b": 7, "c": 9}.get
    pool.begin_test()
    log.clear()
    pool.get("d")  # b is less recently used than c, but c is needed later
    assert log == [("ask", "c"), ("start", "d")] and set(pool.running) == {"a", "b", "d"}


def test_servers_the_current_test_asked_for_are_never_stopped_to_make_room():
    log: list = []
    pool = ServerPool({name: (lambda name=name: RecordingServer(name, log)) for name in "abc"}, max_running=1)
    pool.begin_test()
    pool.get("a")
    pool.get("b")  # the same test: a stays, though that exceeds max_running
    pool.make_room(1)  # a test's own server: nothing of this test stops for it
    assert list(pool.running) == ["a", "b"] and ("ask", "a") not in log
    pool.begin_test()
    pool.make_room(1)
    assert pool.running == {}


def test_a_server_that_failed_to_start_fails_later_gets_without_starting_again():
    log: list = []
    pool = ServerPool({"bad": lambda: RecordingServer("bad", log, fails=True)})
    with pytest.raises(ServerStartError, match="bad failed"):
        pool.get("bad")
    log.clear()
    with pytest.raises(ServerStartError, match="failed to start earlier"):
        pool.get("bad")
    assert log == []


def test_a_prefetched_server_is_launched_early_and_only_waited_for_when_asked():
    log: list = []
    pool = ServerPool({name: (lambda name=name: RecordingServer(name, log)) for name in "abcd"}, max_running=2)
    pool.begin_test()
    pool.get("a")
    assert pool.prefetch("b", keep={"a"}) and log[-1] == ("launch", "b") and "b" not in pool.running
    assert not pool.prefetch("b", keep=set())  # launched already
    # full (a running, b launched), and a is needed before c: no room for c yet
    assert not pool.prefetch("c", keep={"a"}) and ("launch", "c") not in log
    pool.begin_test()
    log.clear()
    assert pool.get("b")[0] is pool.made["b"] and log == [("ready", "b")]  # waited for, not started again
    pool.begin_test()
    assert pool.prefetch("c", keep={"b"})  # a is idle and not needed before: it stops for c
    assert log[1:] == [("ask", "a"), ("launch", "c")] and list(pool.running) == ["b"]
    log.clear()
    pool.stop()  # a launched server is stopped too, and a stopping one waited for
    assert ("ask", "c") in log and ("wait", "a") in log and pool.launched == {} and pool.stopping == {}
    # each launch counted once (b's wait after its prefetch is not a second one), waits by name
    assert pool.starts == {"a": 1, "b": 1, "c": 1} and set(pool.waited_s) == {"a", "b"}
    assert pool.start_report()[-1].startswith("all") and " 3 launch(es)" in pool.start_report()[-1]


def test_a_server_still_draining_is_waited_for_before_it_starts_again_and_killed_when_overdue():
    log: list = []
    pool = ServerPool({name: (lambda name=name: RecordingServer(name, log)) for name in "ab"}, max_running=1)
    pool.begin_test()
    a = pool.get("a")[0]
    pool.begin_test()
    pool.get("b")
    a.draining = True  # SGLang still draining a
    pool.begin_test()
    assert list(pool.stopping) == ["a"] and ("wait", "a") not in log  # not waited for while it drains
    log.clear()
    pool.get("a")  # a again: its stop is finished first (its port), b is asked to stop for it
    assert log == [("ask", "b"), ("wait", "a"), ("start", "a")] and a.wait_timeouts == [DRAIN_S]
    b = pool.made["b"]
    b.draining = True
    pool.stopping["b"] -= DRAIN_S + 1  # draining for longer than a stop may take
    pool.begin_test()
    assert pool.stopping == {} and b.wait_timeouts == [0]  # killed at once
