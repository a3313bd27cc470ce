"""A benchmark run stopped from outside (``timeout``, a cancelled CI job) leaves no process and no file behind."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
import weakref
from pathlib import Path
from typing import Any

import pytest

pytestmark = pytest.mark.skipif(
    not os.path.exists(f"/proc/self/task/{threading.get_native_id()}/children"),
    reason="reads child processes from /proc's lists of children (Linux)")

#: The run's own command line, with SIGHUP as the system sets it (a test run under nohup would ignore it).
RUN_BENCH = ("import signal, sys; signal.signal(signal.SIGHUP, signal.SIG_DFL); "
             "from fastembed.benchmark.cli import main; sys.exit(main(sys.argv[1:]))")


def descendants(pid: int) -> set[int]:
    """Every live process below `pid`, from /proc's lists of children."""
    found: set[int] = set()
    waiting = [pid]
    while waiting:
        parent = waiting.pop()
        try:
            threads = os.listdir(f"/proc/{parent}/task")
        except FileNotFoundError:
            continue
        for thread in threads:
            try:
                children = Path(f"/proc/{parent}/task/{thread}/children").read_text().split()
            except (FileNotFoundError, ProcessLookupError):
                continue
            for child in map(int, children):
                if child not in found:
                    found.add(child)
                    waiting.append(child)
    return found


def alive(pid: int) -> bool:
    """Whether `pid` runs (a zombie waiting for a reaper has ended)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()[0]
    except (FileNotFoundError, ProcessLookupError):
        return False
    return state != "Z"


def command_line(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
    except (FileNotFoundError, ProcessLookupError):
        return ""


@pytest.fixture
def start_bench(tmp_path):
    """Start ``fastembed-bench`` in its own process, its temporary files in a folder of the test's; whatever of it
    a failing test leaves running is killed at the end."""
    started: list[subprocess.Popen] = []
    seen: set[int] = set()

    def start(arguments: list[str], own_session: bool = False) -> tuple[subprocess.Popen, Path]:
        """`own_session`: the run leads a process group of its own, which a test signals as a terminal's Ctrl-C does."""
        temporary = tmp_path / "tmp"
        temporary.mkdir()
        env = {**os.environ, "TMPDIR": str(temporary)}
        bench = subprocess.Popen([sys.executable, "-c", RUN_BENCH, *arguments, "--out", str(tmp_path / "out")],
                                 stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, env=env,
                                 start_new_session=own_session)
        started.append(bench)
        return bench, temporary

    start.seen = seen  # the children a test saw, killed at the end if still running
    yield start
    for bench in started:
        seen |= descendants(bench.pid)
        bench.kill()
        bench.wait()
        bench.stderr.close()
    outliving(seen, seconds=0)


def wait_for(condition, bench: subprocess.Popen, seconds: float = 240.0) -> None:
    deadline = time.monotonic() + seconds
    while not condition():
        if bench.poll() is not None:
            pytest.fail(f"the run ended before the test could stop it: {bench.stderr.read()}")
        if time.monotonic() > deadline:
            bench.kill()
            pytest.fail("the run never reached the point where the test stops it")
        time.sleep(0.1)


def outliving(pids: set[int], seconds: float = 30.0) -> set[int]:
    """Those of `pids` still running after `seconds`, killed then, so that a failing test leaves none spinning."""
    deadline = time.monotonic() + seconds
    while any(alive(pid) for pid in pids) and time.monotonic() < deadline:
        time.sleep(0.1)
    left = {pid for pid in pids if alive(pid)}
    for pid in left:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:  # it ended meanwhile
            pass
    return left


def load_pids(bench: subprocess.Popen) -> set[int]:
    return {pid for pid in descendants(bench.pid) if "while os.getppid()" in command_line(pid)}


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGHUP, signal.SIGINT])
def test_a_signal_ends_the_competing_load_and_the_workers_and_removes_the_table_copy(start_bench, signum):
    bench, temporary = start_bench(["--processes", "50", "--load", "--vocab-size", "3000", "--dim", "64",
                                    "--batch", "64"])
    wait_for(lambda: load_pids(bench) and any(temporary.iterdir()), bench)
    children = descendants(bench.pid)
    start_bench.seen |= children
    bench.send_signal(signum)
    status = bench.wait(timeout=60)
    assert not outliving(children), "a child process outlived the run"
    assert status == 128 + signum
    stderr = bench.stderr.read()
    assert f"stopped by {signal.Signals(signum).name}" in stderr and "Traceback" not in stderr, stderr
    assert not list(temporary.iterdir()), "the table's temporary copy was left on disk"


def rank_pids(bench: subprocess.Popen) -> set[int]:
    return {pid for pid in descendants(bench.pid) if "spawn_main" in command_line(pid)}


def assert_a_ctrl_c_prints_one_line(start_bench, arguments: list[str], started) -> None:
    """A run of `arguments`, sent SIGINT as a terminal's Ctrl-C is (its whole process group) once `started(run)` holds,
    ends with one line, no traceback of any of its processes, and no process left."""
    bench, _ = start_bench(arguments, own_session=True)
    wait_for(lambda: started(bench), bench)
    children = descendants(bench.pid)
    start_bench.seen |= children
    os.killpg(bench.pid, signal.SIGINT)
    status = bench.wait(timeout=60)
    assert not outliving(children), "a child process outlived the run"
    stderr = bench.stderr.read()
    assert status == 128 + signal.SIGINT and "Traceback" not in stderr, stderr
    assert stderr.strip().splitlines()[-1] == "fastembed-bench: stopped by SIGINT", stderr


def test_a_ctrl_c_at_the_terminal_prints_one_line_and_no_traceback_of_the_load(start_bench):
    """The load shared the run's process group, so a Ctrl-C interrupted it too, and it printed a KeyboardInterrupt."""
    assert_a_ctrl_c_prints_one_line(
        start_bench, ["--processes", "50", "--load", "--vocab-size", "3000", "--dim", "64", "--batch", "64"], load_pids)


def test_a_ctrl_c_while_the_ranks_start_prints_one_line_and_no_traceback_of_theirs(start_bench):
    """The ranks, interrupted at the terminal while they imported torch, each printed a KeyboardInterrupt's traceback."""
    pytest.importorskip("torch")
    # As soon as the ranks are spawned: they are importing torch.
    assert_a_ctrl_c_prints_one_line(
        start_bench, ["--ranks", "2", "--vocab-size", "1000", "--dim", "64", "--batch", "64", "--reps", "300"], rank_pids)


class _Stopped(BaseException):
    """Raised by a test's own SIGTERM handler, as the benchmark's raises its Terminated."""


class _FakeRanks:
    """torch.multiprocessing for :func:`fastembed.benchmark.ranks._spawned`: each start sends `signum` to another
    thread and runs on past Python's signal checks before the started process is recorded, as a real start does."""

    def __init__(self, signum: int, other: threading.Thread) -> None:
        self.signum, self.other = signum, other
        self.started: list[_FakeRanks.Rank] = []
        self.killed: list[_FakeRanks.Rank] = []
        self.seen_while_starting: list[tuple[Any, bool]] = []

    class Rank:
        def __init__(self, ranks: _FakeRanks) -> None:
            self.ranks = ranks

        def kill(self) -> None:
            self.ranks.killed.append(self)

        def join(self) -> None:
            pass

    class Context:
        error_files: list[str] = []

        def join(self) -> bool:
            return True

    def active_children(self) -> list[Rank]:
        return list(self.started)

    def start_processes(self, function: Any, args: tuple[Any, ...], nprocs: int, join: bool,
                        start_method: str) -> Context:
        for _ in range(nprocs):
            self.seen_while_starting.append(
                (signal.getsignal(signal.SIGHUP), signal.SIGINT in signal.pthread_sigmask(signal.SIG_BLOCK, [])))
            signal.pthread_kill(self.other.ident, self.signum)  # a signal to the process that another thread takes
            time.sleep(0.05)
            self.started.append(self.Rank(self))
        return self.Context()


@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM], ids=["SIGINT", "SIGTERM"])
def test_a_signal_another_thread_takes_while_the_ranks_start_waits_until_each_is_recorded_and_ended(signum):
    """A Ctrl-C that a thread of torch's took was raised on the main thread inside a rank's start, after its process
    existed and before it was recorded: nothing ended it, and it printed a traceback failing to read its arguments."""
    from fastembed.benchmark import ranks

    def stop(_signum: int, _frame: Any) -> None:
        raise _Stopped

    ends = threading.Event()
    other = threading.Thread(target=ends.wait, daemon=True)  # started before the ranks: SIGINT unblocked there
    other.start()
    previous = {number: signal.signal(number, handler) for number, handler in
                ((signal.SIGTERM, stop), (signal.SIGHUP, signal.SIG_IGN))}
    fake = _FakeRanks(signum, other)
    try:
        with pytest.raises(KeyboardInterrupt if signum == signal.SIGINT else _Stopped):
            ranks._spawned(fake, None, (), 2)
        assert signal.getsignal(signal.SIGTERM) is stop, "the handler of the run was not given back"
    finally:
        ends.set()
        for number, handler in previous.items():
            signal.signal(number, handler)
    assert len(fake.started) == 2 and set(fake.killed) == set(fake.started)
    # An ignored SIGHUP stays ignored while the ranks start (they inherit it: nohup), and they start with SIGINT blocked.
    assert fake.seen_while_starting == [(signal.SIG_IGN, True)] * 2


def test_ranks_end_when_the_run_is_killed_while_they_start(start_bench):
    """torch asks for the ranks' parent-death signal only once they have imported torch: a run killed before that
    left its ranks to run their whole workload."""
    pytest.importorskip("torch")
    bench, _ = start_bench(["--ranks", "2", "--vocab-size", "1000", "--dim", "64", "--batch", "64",
                            "--reps", "100000"])
    wait_for(lambda: rank_pids(bench), bench)  # the ranks have just been spawned: they are importing torch
    children = descendants(bench.pid)
    start_bench.seen |= children
    bench.kill()
    bench.wait(timeout=60)
    assert not outliving(children, seconds=30), "a rank outlived the killed run"


def test_the_load_ends_with_its_parent_where_no_parent_death_signal_ends_it(tmp_path):
    """The load's only tie to a killed run was Linux's parent-death signal; elsewhere it spun on."""
    listed = tmp_path / "children"
    parent = textwrap.dedent("""
        import os, sys
        from pathlib import Path
        from fastembed.benchmark import processes
        processes._END_WITH_PARENT = ""  # as on a system without a parent-death signal
        with processes.competing_load(True):
            me = os.getpid()
            children = [child for thread in os.listdir(f"/proc/{me}/task")
                        for child in Path(f"/proc/{me}/task/{thread}/children").read_text().split()]
            Path(sys.argv[1]).write_text(" ".join(children))
            os._exit(0)  # as a killed run ends: no cleanup
    """)
    # No pipe: the load inherits the parent's descriptors, and a load that lives on would keep a pipe open.
    started = subprocess.run([sys.executable, "-c", parent, str(listed)], stdout=subprocess.DEVNULL,
                             stderr=subprocess.DEVNULL, timeout=120)
    loads = {int(pid) for pid in listed.read_text().split()} if listed.exists() else set()
    assert loads, f"the parent listed no load (exit status {started.returncode})"
    assert not outliving(loads, seconds=30), "the load outlived its parent"


def test_the_files_where_ranks_write_their_errors_are_removed(tmp_path):
    """torch reads the file a failed rank wrote its traceback to and never removes it: a rank that failed as the run
    was stopped left one in the temporary folder."""
    from fastembed.benchmark import ranks

    written = tmp_path / "pytorch-errorfile-rank1.pickle"
    never_written = tmp_path / "pytorch-errorfile-rank0.pickle"

    class Context:
        error_files = [str(never_written), str(written)]

        @staticmethod
        def join():
            written.write_bytes(b"a rank's traceback")
            raise KeyboardInterrupt  # the run stopped while the ranks ran

    class Spawner:
        active_children = staticmethod(lambda: [])

        @staticmethod
        def start_processes(*args, **kwargs):
            return Context()

    with pytest.raises(KeyboardInterrupt):
        ranks._spawned(Spawner, None, (), 2)
    assert not written.exists() and not never_written.exists()


def test_a_killed_run_takes_its_competing_load_with_it(start_bench):
    bench, _ = start_bench(["--processes", "50", "--load", "--vocab-size", "3000", "--dim", "64", "--batch", "64"])
    wait_for(lambda: load_pids(bench), bench)
    load = load_pids(bench)
    start_bench.seen |= descendants(bench.pid)
    bench.kill()
    bench.wait(timeout=60)
    assert not outliving(load), "the CPU-bound load went on spinning after the run was killed"


def test_a_signal_during_a_ranks_run_ends_every_rank_and_removes_the_rendezvous(start_bench):
    pytest.importorskip("torch")
    bench, temporary = start_bench(["--ranks", "2", "--vocab-size", "3000", "--dim", "64", "--batch", "64"])
    ranks_started = lambda: sum("spawn_main" in command_line(pid) for pid in descendants(bench.pid)) >= 2  # noqa: E731
    wait_for(ranks_started, bench)
    children = descendants(bench.pid)
    start_bench.seen |= children
    bench.send_signal(signal.SIGTERM)
    status = bench.wait(timeout=60)
    assert not outliving(children), "a rank outlived the run"
    assert status == 128 + signal.SIGTERM
    assert not list(temporary.iterdir()), "the run's temporary files were left on disk"


@pytest.mark.skipif(threading.current_thread() is not threading.main_thread(), reason="signal handlers: main thread only")
def test_a_second_signal_while_the_run_cleans_up_is_ignored_and_the_handlers_come_back_after():
    from fastembed.benchmark.cli import Terminated, _ending_signals_raise

    before = signal.getsignal(signal.SIGTERM)
    if before is not signal.SIG_DFL:
        pytest.skip("SIGTERM has a handler of the test run's: the benchmark leaves it as it is")
    cleaned = False
    with pytest.raises(Terminated), _ending_signals_raise():
        try:
            os.kill(os.getpid(), signal.SIGTERM)
            time.sleep(5)  # the handler raises before this ends
        finally:
            os.kill(os.getpid(), signal.SIGTERM)  # as `timeout` sends it again: ignored, the cleanup goes on
            time.sleep(0.05)
            cleaned = True
    assert cleaned
    assert signal.getsignal(signal.SIGTERM) is before


@pytest.mark.skipif(threading.current_thread() is not threading.main_thread(),
                    reason="signal handlers: main thread only")
@pytest.mark.parametrize("run_goes_on", [True, False])
def test_a_signal_whose_handler_ran_inside_a_finalizer_comes_again_and_ends_the_run(run_goes_on):
    """Python drops an exception that leaves a finalizer (the output cache's, say): the signal comes again once
    the finalizer has returned, and ends the run as any other; a run that ends first ends as the signal would."""
    from fastembed.benchmark.cli import Terminated, _ending_signals_raise

    before = signal.getsignal(signal.SIGTERM)
    if before is not signal.SIG_DFL:
        pytest.skip("SIGTERM has a handler of the test run's: the benchmark leaves it as it is")

    class Output:
        pass

    def freed() -> None:
        os.kill(os.getpid(), signal.SIGTERM)  # its handler raises here, inside the finalizer
        time.sleep(0.01)

    waited = []
    with pytest.raises(Terminated) as ended, _ending_signals_raise():
        output = Output()
        weakref.finalize(output, freed)
        del output
        deadline = time.monotonic() + (5 if run_goes_on else 0)
        while time.monotonic() < deadline:
            time.sleep(0.01)
        waited.append(True)
    assert ended.value.signum == signal.SIGTERM and waited == ([] if run_goes_on else [True])
    assert signal.getsignal(signal.SIGTERM) is before
    time.sleep(0.1)  # the signal sent again after the run: with the default handler back, it is not delivered


def test_ranks_started_before_a_start_is_cut_short_are_ended_too():
    """A signal while torch was still starting the ranks left those it had started running until their timeout."""
    import multiprocessing

    from fastembed.benchmark import ranks

    class CutShort:
        active_children = staticmethod(multiprocessing.active_children)

        @staticmethod
        def start_processes(*args, **kwargs):
            multiprocessing.get_context("spawn").Process(target=time.sleep, args=(60,)).start()
            raise KeyboardInterrupt  # as Terminated would, between two ranks' starts

    try:
        with pytest.raises(KeyboardInterrupt):
            ranks._spawned(CutShort, None, (), 2)
        assert multiprocessing.active_children() == []
    finally:
        for process in multiprocessing.active_children():
            process.kill()
            process.join()


def test_a_competing_load_that_ends_by_itself_is_an_error_not_an_idle_measurement(monkeypatch):
    from fastembed.benchmark import processes

    monkeypatch.setattr(processes, "_END_WITH_PARENT", "raise SystemExit(3)\n")  # as a load that cannot start would
    started = []
    real_popen = subprocess.Popen
    monkeypatch.setattr(processes.subprocess, "Popen", lambda *args, **kwargs: started.append(
        real_popen(*args, **kwargs)) or started[-1])
    with pytest.raises(RuntimeError, match=r"the competing load ended by itself \(exit status 3\)"):
        with processes.competing_load(True):
            started[0].wait(timeout=60)  # its interpreter has ended
