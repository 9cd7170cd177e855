"""The hook's step record writer (kv_exporter/plugin/_steps.c) and its wrapping of a runner's execute_model
(kv_exporter/plugin/steps.py): what it writes, and that it is never in the model's way."""

from __future__ import annotations

import gc
import os
import shutil
import subprocess
import sys
import time
import tracemalloc
from pathlib import Path
from typing import Any

import pytest

from kv_exporter.manifest import ProcessInfo
from kv_exporter.plugin import steps
from kv_exporter.plugin._steps import Record, StepWrapper
from kv_exporter.steprecord import BUCKET_NS, RECORD_BYTES, RecordWriter, StepRecord, decode, new_record
from tests.support.constants import REPO
from tests.support.plugin_state import forget_warnings


@pytest.fixture(autouse=True)
def fresh_warnings() -> None:
    forget_warnings()  # one warning per kind of failure per process: each test sees its own


class SchedulerOutput:
    def __init__(self, sequences: int) -> None:
        self.num_scheduled_tokens = {f"req-{i}": 1 for i in range(sequences)}


class Failure(Exception):
    pass


class Runner:
    def __init__(self) -> None:
        self.calls: list[tuple[Any, ...]] = []
        self.result = object()

    def execute_model(self, scheduler_output: Any, intermediate_tensors: Any = None, dummy_run: bool = False) -> Any:
        self.calls.append((scheduler_output, intermediate_tensors, dummy_run))
        if isinstance(scheduler_output, Failure):
            raise scheduler_output
        return self.result


def read(data: bytearray) -> StepRecord:
    record = decode(bytes(data))
    assert isinstance(record, StepRecord)
    return record


def wrapped() -> tuple[Runner, bytearray]:
    data = bytearray(new_record(os.getpid(), 1))
    runner = Runner()
    runner.execute_model = StepWrapper(runner.execute_model, Record(data))  # type: ignore[method-assign]
    return runner, data


def test_each_step_writes_its_sequences_and_returns_what_the_method_returns() -> None:
    runner, data = wrapped()
    before = time.monotonic_ns()
    assert runner.execute_model(SchedulerOutput(3)) is runner.result
    assert runner.execute_model(SchedulerOutput(7), "tensors") is runner.result
    assert runner.execute_model(scheduler_output=SchedulerOutput(2)) is runner.result
    record = read(data)
    assert (record.steps, record.finished, record.latest, record.unreadable) == (3, 3, 2, 0)
    assert [c[1] for c in runner.calls] == [None, "tensors", None]
    # The coarse clock: within a tick (a few ms) of CLOCK_MONOTONIC.
    assert before - 10_000_000 <= record.latest_started_ns <= record.latest_finished_ns <= time.monotonic_ns()
    assert record.most_in(before // BUCKET_NS - 1, time.monotonic_ns() // BUCKET_NS) == 7


def test_a_dummy_run_runs_no_request_and_is_not_a_step() -> None:
    runner, data = wrapped()
    runner.execute_model(SchedulerOutput(5), dummy_run=True)
    assert read(data).steps == 0 and len(runner.calls) == 1


def test_a_count_it_cannot_read_is_written_as_unknown_and_the_step_runs() -> None:
    runner, data = wrapped()
    assert runner.execute_model(object()) is runner.result
    with pytest.raises(TypeError):  # no scheduler output at all: the method's own error
        runner.execute_model()  # type: ignore[call-arg]
    record = read(data)
    assert (record.steps, record.finished, record.latest, record.unreadable) == (2, 2, None, 2)


def test_what_the_method_raises_passes_through_unchanged_and_the_step_ends() -> None:
    runner, data = wrapped()
    failure = Failure("boom")
    with pytest.raises(Failure) as raised:
        runner.execute_model(failure)
    assert raised.value is failure
    record = read(data)
    assert (record.steps, record.finished) == (1, 1)


def test_the_wrapper_is_the_bound_method_to_anyone_who_looks() -> None:
    runner, _ = wrapped()
    method = runner.execute_model
    assert method.__name__ == "execute_model" and method.__self__ is runner  # type: ignore[attr-defined]
    assert method.__wrapped__ == Runner.execute_model.__get__(runner)
    assert "execute_model" in repr(method)


class Quiet:
    def execute_model(self, scheduler_output: Any, intermediate_tensors: Any = None) -> Any:
        return scheduler_output


def test_a_step_allocates_nothing() -> None:
    """tracemalloc's peak over many calls: the wrapped method's is the plain method's (only the loop's own)."""
    plain = Quiet().execute_model
    step = StepWrapper(Quiet().execute_model, Record(bytearray(new_record(1, 1))))
    output = SchedulerOutput(8)
    peaks = {}
    for name, method in (("plain", plain), ("wrapped", step)):
        for _ in range(100):
            method(output, None)
        gc.collect()
        tracemalloc.start()
        tracemalloc.reset_peak()
        base = tracemalloc.get_traced_memory()[0]
        for _ in range(10_000):
            method(output, None)
        peaks[name] = tracemalloc.get_traced_memory()[1] - base
        tracemalloc.stop()
    assert peaks["wrapped"] <= peaks["plain"], peaks


STEPS_SCRIPT = """
import sys
from kv_exporter.plugin._steps import Record, StepWrapper
from kv_exporter.steprecord import new_record
class Output:
    num_scheduled_tokens = {"a": 1, "b": 1}
step = StepWrapper(lambda output: output, Record(bytearray(new_record(1, 1))))
output = Output()
for _ in range(int(sys.argv[1])):
    step(output)
"""


@pytest.mark.skipif(shutil.which("strace") is None, reason="no strace (scripts/ensure-system-deps.sh installs it)")
def test_a_step_makes_no_system_call(tmp_path: Path) -> None:
    """strace counts a process's system calls: 200,000 steps make no more than 10 do."""
    totals = []
    for steps_run in (10, 200_000):
        out = tmp_path / f"strace-{steps_run}"
        env = {**os.environ, "PYTHONPATH": str(REPO)}
        command = ["strace", "-f", "-c", "-o", str(out), sys.executable, "-c", STEPS_SCRIPT, str(steps_run)]
        subprocess.run(command, check=True, env=env, timeout=120)
        totals.append(int(out.read_text().strip().splitlines()[-1].split()[-2]))
    assert totals[1] - totals[0] < 20, totals  # Python's own start varies by a few calls


def test_the_c_writer_writes_what_the_protocol_says() -> None:
    """The same steps through the C writer and `RecordWriter`, the protocol in Python: the same bytes but for the
    times, which the C writer takes from the clock."""
    c_data, py_data = bytearray(new_record(7, 9)), bytearray(new_record(7, 9))
    c_record, writer = Record(c_data), RecordWriter(py_data)
    for count in (3, None, 8, 2):
        c_record.begin(count)
        c_record.end()
        now = read(c_data).latest_finished_ns
        writer.begin(count, read(c_data).latest_started_ns)
        writer.end(now)
    assert read(c_data) == read(py_data)


def test_a_record_of_another_shape_is_refused() -> None:
    with pytest.raises(ValueError):
        Record(bytearray(RECORD_BYTES))
    with pytest.raises(ValueError):
        Record(bytearray(new_record(1, 1)) + b"\0")
    with pytest.raises(BufferError):
        Record(bytes(new_record(1, 1)))  # read-only


def test_a_closed_record_lets_every_call_through() -> None:
    runner, data = wrapped()
    runner.execute_model.record.close()  # type: ignore[attr-defined]
    assert runner.execute_model(SchedulerOutput(2)) is runner.result
    assert read(data).steps == 0


# -- on the worker: beside the manifest ------------------------------------------------------------------------


def test_attach_makes_the_record_beside_the_manifest_and_wraps_the_instance(tmp_path: Path) -> None:
    manifest = tmp_path / "m.stage0.engine0.dp0.tp0.pp0.json"
    runner, process = Runner(), ProcessInfo.current()
    path = steps.attach(runner, manifest, process)
    assert path == tmp_path / "m.stage0.engine0.dp0.tp0.pp0.steps"
    assert steps.attach(runner, manifest, process) == path  # the warm-up manifest: the same record, not a second wrap
    assert "execute_model" not in vars(Runner) or not isinstance(Runner.__dict__["execute_model"], StepWrapper)
    runner.execute_model(SchedulerOutput(4))
    record = decode(path.read_bytes())
    assert isinstance(record, StepRecord)
    assert (record.pid, record.start_time_ticks, record.latest) == (process.pid, process.start_time_ticks, 4)
    assert steps.writer_of(path) == (process.pid, process.start_time_ticks)
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")], "no temporary file left"


def test_an_object_without_execute_model_gets_no_record(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    assert steps.attach(object(), tmp_path / "o.json", ProcessInfo.current()) is None
    assert list(tmp_path.iterdir()) == [] and not caplog.records


def test_a_runner_that_cannot_be_wrapped_leaves_no_record(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    class Frozen:
        __slots__ = ()

        def execute_model(self, scheduler_output: Any) -> None:
            return None

    assert steps.attach(Frozen(), tmp_path / "f.json", ProcessInfo.current()) is None
    assert list(tmp_path.iterdir()) == []
    assert any("no step record" in r.getMessage() for r in caplog.records)


def test_a_forked_child_writes_nothing_into_its_parent_s_record(tmp_path: Path) -> None:
    runner = Runner()
    path = steps.attach(runner, tmp_path / "fork.json", ProcessInfo.current())
    assert path is not None
    child = os.fork()
    if child == 0:  # pragma: no cover - the child's exit status is the assertion
        runner.execute_model(SchedulerOutput(6))
        os._exit(0 if len(runner.calls) == 1 else 1)
    _, status = os.waitpid(child, 0)
    assert status == 0
    record = decode(path.read_bytes())
    assert isinstance(record, StepRecord) and record.steps == 0
