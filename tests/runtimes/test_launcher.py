"""free_port: the ports handed to child processes stay clear of the kernel's ephemeral range."""

from __future__ import annotations

import os
import socket

from tandem.runtimes.launcher import _ephemeral_ports, free_port


def test_free_ports_are_bindable_distinct_and_below_the_ephemeral_range():
    low, _ = _ephemeral_ports()
    ports = [free_port() for _ in range(50)]
    assert len(set(ports)) == len(ports)
    assert all(1024 <= p < low for p in ports)
    for port in ports[:5]:
        with socket.socket() as s:
            s.bind(("127.0.0.1", port))


def test_a_port_in_use_is_not_handed_out(monkeypatch):
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy_port = busy.getsockname()[1]
        busy.listen()
        # Every draw hits the busy port: free_port must skip it and fall back on the kernel's choice.
        monkeypatch.setattr("tandem.runtimes.launcher._ephemeral_ports", lambda: (busy_port + 1, 60999))
        monkeypatch.setattr("random.SystemRandom.randint", lambda self, a, b: busy_port)
        assert free_port() != busy_port


class FakeProcess:
    """What Supervisor reads of a ServiceProcess. `dead`: every start of it exits at once."""

    def __init__(self, name: str, dead: bool):
        self.name, self.url, self.starts, self.dead, self.ready = name, f"http://{name}", 0, dead, True
        self.log = type("Log", (), {"name": f"/tmp/{name}.log"})()
        self.proc = type("Proc", (), {"poll": lambda _: 1 if self.dead else None, "returncode": 1})()

    def start(self):
        self.starts += 1
        return self

    def is_ready(self, path: str = "/ready", timeout_s: float = 2.0) -> bool:
        return self.ready

    def log_tail(self, chars: int = 4000) -> str:
        return self.tail

    tail = "Traceback ... the reason"


def test_a_crash_looping_process_is_retried_with_a_doubling_delay_and_the_others_go_on():
    from tandem.runtimes.local_stack import MAX_BACKOFF_S, Supervisor

    flaky, steady = FakeProcess("decode-1", dead=True), FakeProcess("router", dead=False)
    supervisor = Supervisor([flaky, steady], now=0.0)
    restarts = []
    for tick in range(1, 401):  # 200 s in half seconds
        before = flaky.starts
        supervisor.check(tick * 0.5)
        if flaky.starts > before:
            restarts.append(tick * 0.5)
    # Each exit is noticed half a second after its start; then 1, 3, 7, 15, 30, 30 ... seconds to the next try.
    gaps = [b - a for a, b in zip(restarts, restarts[1:])]
    assert restarts[0] == 1.5 and gaps[:5] == [3.5, 7.5, 15.5, 30.5, 30.5]
    assert max(gaps) == MAX_BACKOFF_S + 0.5
    assert steady.starts == 0  # the rest of the stack goes on untouched


def test_a_process_that_ran_a_while_before_exiting_is_restarted_at_once():
    from tandem.runtimes.local_stack import RESTART_GRACE_S, Supervisor

    worker = FakeProcess("prefill-0", dead=True)
    supervisor = Supervisor([worker], now=0.0)
    supervisor.check(RESTART_GRACE_S + 1)  # its exit, after a long run, is noticed
    supervisor.check(RESTART_GRACE_S + 1)  # and the restart is due at once
    assert worker.starts == 1


def test_one_crash_is_not_called_a_loop_and_the_restarted_process_is_said_to_be_back(capsys):
    """Found by a newcomer's walkthrough: one `kill -KILL` of a worker was said as "keeps exiting", and nothing said
    when it served again."""
    from tandem.runtimes.local_stack import Supervisor

    worker = FakeProcess("decode-1", dead=True)
    supervisor = Supervisor([worker], now=0.0)
    supervisor.check(5.0)  # killed soon after its start
    said = capsys.readouterr().err
    assert "decode-1 exited with 1" in said and "restarted in 1 s" in said and "keeps exiting" not in said
    worker.dead, worker.ready = False, False
    supervisor.check(6.0)  # restarted, loading its model
    supervisor.check(6.5)
    said = capsys.readouterr().err
    assert "restarting decode-1" in said and "serving again" not in said
    worker.ready = True
    supervisor.check(7.0)
    supervisor.check(7.5)  # said once
    assert capsys.readouterr().err.count("decode-1 is serving again on http://decode-1") == 1
    worker.dead = True
    supervisor.check(8.0)  # a second quick exit: now it is a loop
    assert "decode-1 keeps exiting; next try in 3 s" in capsys.readouterr().err


def test_a_port_whose_last_connection_is_in_time_wait_is_free_for_the_router():
    """A stack just stopped leaves its router's port in TIME_WAIT; uvicorn binds it (SO_REUSEADDR), so serve must
    not call it taken. A port something listens on is taken."""
    import socket

    from tandem.runtimes.launcher import port_in_use

    server = socket.socket()
    server.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    server.bind(("127.0.0.1", 0))
    server.listen()
    port = server.getsockname()[1]
    assert port_in_use("127.0.0.1", port)
    client = socket.create_connection(("127.0.0.1", port))
    accepted, _ = server.accept()
    accepted.close()  # the server closes first: its side of the connection waits in TIME_WAIT
    client.recv(1)
    client.close()
    server.close()
    assert not port_in_use("127.0.0.1", port)


class StoppingProcess:
    """What stop_all calls of a ServiceProcess, recorded; `interrupted`: Ctrl-C arrives while it stops."""

    def __init__(self, name: str, calls: list, interrupted: bool = False):
        self.name, self.calls, self.interrupted = name, calls, interrupted

    def stop(self, timeout: float = 15.0):
        self.calls.append(("stop", self.name, timeout))
        if self.interrupted:
            raise KeyboardInterrupt

    def kill(self):
        self.calls.append(("kill", self.name))


def test_the_router_stops_first_with_time_to_finish_and_ctrl_c_again_kills_everything():
    from tandem.runtimes.local_stack import ROUTER_GRACE_S, stop_all

    calls: list = []
    stop_all(StoppingProcess("router", calls), [StoppingProcess("prefill-0", calls), StoppingProcess("decode-1", calls)])
    assert calls == [("stop", "router", ROUTER_GRACE_S + 5), ("stop", "prefill-0", 15.0), ("stop", "decode-1", 15.0)]
    calls.clear()
    stop_all(StoppingProcess("router", calls, interrupted=True), [StoppingProcess("decode-1", calls)])
    assert calls == [("stop", "router", ROUTER_GRACE_S + 5), ("kill", "router"), ("kill", "decode-1")]


def test_a_cleanly_stopped_process_leaves_no_log_and_one_that_was_killed_keeps_it():
    from tandem.runtimes.launcher import ServiceProcess

    router = ServiceProcess(["router", "--model", "smollm2", "--decode", "http://127.0.0.1:9"], name="log-test")
    router.start().wait_ready(path="/health")
    first_log = router.log.name
    assert router.stop() in (0, -15) and not os.path.exists(first_log)  # /tmp no longer fills up with them
    router.start().wait_ready(path="/health")  # a start after that writes a new one
    assert router.log.name != first_log and os.path.exists(router.log.name)
    router.kill()  # as a crash: its log is what tells why
    assert os.path.exists(router.log.name) and router.stop() is not None
    os.unlink(router.log.name)


def test_a_log_tail_begins_at_a_whole_line():
    """What `tandem serve` prints of a process that exited: the end of its log from a line's start, not from the
    middle of one."""
    from tandem.runtimes.launcher import ServiceProcess

    process = ServiceProcess(["worker"], port=1, name="tail-test")
    try:
        process.log.write(b"".join(f"line {i:04d} {'x' * 40}\n".encode() for i in range(200)))
        process.log.flush()
        tail = process.log_tail(500)
        assert 0 < len(tail) <= 500
        assert all(line.startswith("line ") and len(line) == 50 for line in tail.splitlines())
        assert tail.endswith("line 0199 " + "x" * 40 + "\n")
        assert process.log_tail(100_000).startswith("line 0000 ")  # the whole log: nothing is cut
        process.log.write(b"E" * 5000 + b"\n")  # a last line longer than the tail: its end, rather than nothing
        process.log.flush()
        assert process.log_tail(4000) == "E" * 3999 + "\n"
    finally:
        process.log.close()
        os.remove(process.log.name)



def test_a_log_tail_leaves_out_routine_lines():
    """A crashed worker's tail was a dozen httpx "HTTP Request:" lines, its reason scrolled out of the window."""
    from tandem.runtimes.launcher import ServiceProcess

    process = ServiceProcess(["worker"], port=1, name="routine-tail-test")
    try:
        process.log.write(b"2026-01-01 00:00:00 ERROR tandem.workers: Traceback ...\nValueError: the reason\n")
        process.log.write(b"".join(b"2026-01-01 00:00:01 INFO httpx: HTTP Request: POST http://127.0.0.1:9/internal/kv"
                                   b"/release \"HTTP/1.1 200 OK\"\n" for _ in range(60)))
        process.log.write(b"2026-01-01 00:00:02 WARNING httpx: HTTP Request: kept, a warning\n")
        process.log.flush()
        tail = process.log_tail(1500)
        assert "ValueError: the reason" in tail and "INFO httpx" not in tail and "kept, a warning" in tail
    finally:
        process.log.close()
        os.remove(process.log.name)


def test_a_process_that_never_started_leaves_no_log():
    """A start that failed (or was interrupted) before the router's left its empty log behind in /tmp."""
    from tandem.runtimes.launcher import ServiceProcess

    process = ServiceProcess(["router"], port=1, name="never-started")
    assert os.path.exists(process.log.name)
    assert process.stop() is None and not os.path.exists(process.log.name)


def test_serve_on_a_port_in_use_creates_no_process_and_no_log(monkeypatch, capsys):
    from tandem.config import EngineConfig
    from tandem.runtimes.local_stack import run_local_stack

    def no_process(*args, **kwargs):
        raise AssertionError("a process (and its log file) was made for a stack that cannot start")

    monkeypatch.setattr("tandem.runtimes.local_stack.ServiceProcess", no_process)
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        code = run_local_stack(EngineConfig(), prefill=1, decode=1, colocated=False, disagg_min_tokens=512,
                               host="127.0.0.1", port=taken.getsockname()[1])
    assert code == 2
    said = capsys.readouterr().err
    assert "is in use" in said and "--port 9000" in said and 'make serve ARGS="--port 9000"' in said


def test_a_slow_start_is_put_down_to_compiling_only_while_a_worker_compiles():
    from tandem.runtimes.local_stack import slow_start_notice
    from tandem.workers.kernels.cpu_extension import COMPILING

    workers = [FakeProcess("prefill-0", dead=False), FakeProcess("decode-1", dead=False)]
    for worker in workers:
        worker.tail = "INFO tandem.workers.kernels.cpu_extension: loading the native CPU kernels\n"
    notice = slow_start_notice(workers, workers)
    assert "loading the model" in notice and "compil" not in notice and "/tmp/decode-1.log" in notice
    workers[1].tail = f"INFO tandem.workers.kernels.cpu_extension: {COMPILING}\n"
    assert "compiling the native CPU kernels" in slow_start_notice(workers, workers)
