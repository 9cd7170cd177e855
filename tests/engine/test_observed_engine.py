"""Observed beside declared in a real vLLM 0.32 CPU server, default multi-process layout, with --enforce-eager and
without it (vLLM's CPU default then compiles the Qwen2 backbone with dynamo and inductor; the owners run beside it,
outside the compiled region, as a model's side modules do).

The served architecture (kvx_testplugin/observed.py) has four inner owners whose real transformers caches live and
die with the requests: `truthful` (declares max_num_seqs rows, holds one per running request), `under` (declares one
FIXED row, holds one per running request), `undeclared` (declares nothing, holds one per running request) and `never`
(declares max_num_seqs rows, never allocates). The worker samples every second (KV_EXPORTER_OBSERVE_INTERVAL=1); a
real sidecar reads its manifest and the engine's page. Under sustained load, idle, and with the sampler stopped
(the worker SIGSTOPped), the eager engine's sidecar pages are recorded into tests/fixtures/observed/
(tests/deploy/test_observed_alerts.py runs the shipped alerts on them).

Why the comparison is exact under load, whatever the timing:

- Page against sample. Each scrape is bracketed by two reads of the worker's manifest; when both show the same
  sample (`taken_at`), the page was built from that sample, so the page's figures must equal it to the byte.
- Sample against the model. The model appends each change of what its holders hold to its own record, with the
  `time.time()` before the change's first cache is made or dropped and after its last, and the bytes
  `measure_cache_bytes` finds in every cache it holds afterwards. A sample spans [taken_at, taken_at + duration_s]
  on the same clock in the same process. When no change overlaps that span, the caches did not change while the
  sample walked them, so it must equal the record's state after the last earlier change. A sample that overlaps a
  change is not compared with the record (it may count part of it; the page-against-sample check still holds).
  The record is read once the load is over, so every change that began before a sample ended is in it.
- Against the geometry. A cache is filled once at admission and never grows, so an owner's bytes are its cache
  count times one cache's bytes from geometry.py, in every sample, overlapping or not.
- The running count is not used for the comparison: the page reads it from the engine at scrape time, seconds
  after or before the sample. The sidecar's arithmetic (unexplained = max(0, observed - ceiling)) is checked on
  each page, with the ceilings from the geometry.
"""

from __future__ import annotations

import itertools
import json
import os
import signal
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TypeVar

import pytest

from kv_exporter.manifest import read_manifest
from kv_exporter.observation import UNATTRIBUTED_OWNER
from tests.engine.observed import (
    HOLDERS,
    OWNERS,
    HeldLog,
    Page,
    Reading,
    cache_bytes,
    distinct_samples,
    read_once,
    sample_figures,
)
from tests.engine.server import MAX_NUM_SEQS, SERVED_NAME, Server, start_server
from tests.engine.testplugin.kvx_testplugin import geometry as g
from tests.engine.tinymodel import build_model
from tests.loadgen import CompletionClients
from tests.openai_server import parent_pid
from tests.support.constants import FIXTURES, UPDATE_FIXTURES_ENV
from tests.support.scrape import parse
from tests.support.sidecar import Sidecar, sidecar

pytestmark = pytest.mark.timeout(900)

RECORDED = FIXTURES / "observed"
CLIENTS = MAX_NUM_SEQS
MIN_LOAD_S = 15.0
# The load goes on until the busy samples are in. A reading needs a scrape that no sample rewrite overlapped, so on a
# machine whose cores stall for seconds (seen here: 4.6 s for a process that only sleeps) few scrapes count; the bound
# is patience, not load: the clients and their requests stay the same.
MAX_LOAD_S = 300.0
SCRAPE_EVERY_S = 0.25
BUSY_SAMPLES = 8  # distinct samples with at least two requests' caches, before the load may stop
WAIT_S = 60.0
T = TypeVar("T")


def ceiling(owner: str) -> int:
    """What each owner declares, from the geometry: max_num_seqs rows, one FIXED row, or nothing."""
    rows = {g.TRUTHFUL_OWNER: MAX_NUM_SEQS, g.UNDER_OWNER: 1, g.UNDECLARED_OWNER: 0, g.NEVER_OWNER: MAX_NUM_SEQS}
    positions = {**g.REQUEST_POSITIONS, g.NEVER_OWNER: g.NEVER_POSITIONS}
    return rows[owner] * cache_bytes(positions[owner])


@dataclass
class Scenario:
    eager: bool
    server: Server
    worker_pid: int
    busy: list[Reading]  # under load, every scrape whose sample is known
    idle: Reading
    stopped: Page  # the sampler stopped (worker SIGSTOPped)
    resumed: Page
    log: HeldLog
    steps: list[tuple[float, float, int]]  # the in-step owner's steps: begin, end, the most its caches held
    completed: int
    scrapes: list[tuple[float, bool]]  # under load: each scrape's seconds, and whether no sample rewrite overlapped it

    def scraped(self) -> str:
        """What the load's scrapes gave, for a failure's message."""
        seconds = sorted(s for s, _ in self.scrapes)
        kept = sum(k for _, k in self.scrapes)
        median = seconds[len(seconds) // 2] if seconds else 0.0
        return f"{kept} of {len(seconds)} scrapes kept, median {median:.3f} s, longest {max(seconds, default=0):.3f} s"


def poll(what: str, read: Callable[[], T | None], done: Callable[[T], bool]) -> T:
    deadline = time.monotonic() + WAIT_S
    while time.monotonic() < deadline:
        found = read()
        if found is not None and done(found):
            return found
        time.sleep(0.5)
    pytest.fail(f"{what}: not seen in {WAIT_S:.0f} s")


def requests_held(reading: Reading) -> int:
    return sample_figures(reading.observation).get(g.UNDER_OWNER, (0, 0))[1]


def busy_samples(readings: list[Reading]) -> int:
    return sum(1 for reading in distinct_samples(readings) if requests_held(reading) >= 2)


def under_load(server: Server, running: Sidecar, manifest: Path) -> tuple[list[Reading], int, list[tuple[float, bool]]]:
    readings: list[Reading] = []
    scrapes: list[tuple[float, bool]] = []
    # Lengths differ per client: requests start and finish at different steps, so caches come and go throughout.
    with CompletionClients(server, SERVED_NAME, CLIENTS, 40, tokens_step=17) as load:
        started = time.monotonic()
        while time.monotonic() - started < MAX_LOAD_S:
            began = time.monotonic()
            reading = read_once(running, manifest)
            scrapes.append((time.monotonic() - began, reading is not None))
            if reading is not None:
                readings.append(reading)
            if time.monotonic() - started >= MIN_LOAD_S and busy_samples(readings) >= BUSY_SAMPLES:
                break
            time.sleep(SCRAPE_EVERY_S)
    assert not load.errors, load.errors[:3]
    return readings, load.completed, scrapes


def warmup_manifest(server: Server) -> Path:
    def published() -> Path | None:
        paths = server.manifests()
        return paths[0] if len(paths) == 1 and read_manifest(paths[0]).phase.value == "warmup" else None

    deadline = time.monotonic() + WAIT_S
    while (path := published()) is None and time.monotonic() < deadline:
        time.sleep(0.5)
    assert path is not None, server.log()[-3000:]
    return path


@pytest.fixture(scope="module", params=["enforce-eager", "torch-compile"])
def scenario(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Scenario]:
    eager = request.param == "enforce-eager"
    workdir = tmp_path_factory.mktemp("observed")
    model = build_model(workdir / "model", architecture=g.OBSERVED_ARCHITECTURE)
    server = start_server(
        workdir / "engine",
        model,
        env={"KV_EXPORTER_OBSERVE_INTERVAL": "1"},  # the peak followed: the default
        args=["--worker-cls", "kvx_testplugin.worker.KvxRequestsCPUWorker", "--shutdown-timeout", "10"],
        eager=eager,
    )
    try:
        server.wait_ready()
        manifest = warmup_manifest(server)
        worker = read_manifest(manifest).process.pid
        args = ("--manifest-dir", str(server.manifest_dir), "--engine-url", server.url("/metrics"), "--no-nvml")
        with sidecar(workdir, *args) as running:
            busy, completed, scrapes = under_load(server, running, manifest)
            idle = poll("every cache released, nothing running", lambda: read_once(running, manifest), is_idle)
            stopped, resumed = sampler_stopped(running, worker)
            log = HeldLog.read(server.report_dir / f"held-{worker}.jsonl")
            steps = read_steps(server.report_dir / f"steps-{worker}.jsonl")
            yield Scenario(eager, server, worker, busy, idle, stopped, resumed, log, steps, completed, scrapes)
    finally:
        server.stop()


def read_steps(path: Path) -> list[tuple[float, float, int]]:
    lines = [json.loads(line) for line in path.read_text().splitlines()]
    return [(line["begin"], line["end"], line["peak"]) for line in lines]


def is_idle(found: Reading) -> bool:
    owners = found.observation.owners
    return found.page.running() == 0 and all((o.bytes, o.caches, o.peak_bytes) == (0, 0, 0) for o in owners)


def sampler_stopped(running: Sidecar, worker: int) -> tuple[Page, Page]:
    """The worker SIGSTOPped until the sidecar calls its sample stale; its page then, and once it is resumed."""

    def page() -> Page:
        text = running.text()
        return Page(text, parse(text))

    os.kill(worker, signal.SIGSTOP)
    try:
        stopped = poll("the stopped sampler's state", page, lambda p: p.state() == "stale")
    finally:
        os.kill(worker, signal.SIGCONT)
    resumed = poll("the resumed sampler's state", page, lambda p: p.state() == "ok")
    return stopped, resumed


def comparable(scenario: Scenario) -> list[tuple[Reading, dict[str, tuple[int, int]]]]:
    """The distinct busy samples no change overlapped, with what the model's record says it held then."""
    found = []
    for reading in distinct_samples(scenario.busy):
        taken = reading.observation
        state = scenario.log.state_during(taken.taken_at, taken.taken_at + taken.duration_s)
        if state is not None:
            found.append((reading, state))
    return found


# -- the tests ---------------------------------------------------------------------------------------------------


def test_the_worker_process_samples_and_serving_goes_on(scenario: Scenario) -> None:
    [path] = scenario.server.manifests()
    manifest = read_manifest(path)
    assert manifest.process.pid == scenario.worker_pid != scenario.server.pid
    assert parent_pid(parent_pid(scenario.worker_pid)) == scenario.server.pid  # API server -> engine core -> worker
    assert {d.owner for d in manifest.declarations} == {g.TRUTHFUL_OWNER, g.UNDER_OWNER, g.NEVER_OWNER}
    assert manifest.observation is not None and manifest.observation.interval_s == 1.0
    log = scenario.server.log()
    assert f"enforce_eager={scenario.eager}," in log
    # Without it vLLM's CPU platform compiles the backbone, as the engine's config line says.
    assert ("'mode': <CompilationMode.DYNAMO_TRACE_ONCE" in log) is not scenario.eager
    assert scenario.completed >= CLIENTS
    assert scenario.server.completion("Still serving", 8)["usage"]["completion_tokens"] == 8


def test_the_page_shows_the_sample_it_was_built_from(scenario: Scenario) -> None:
    assert len(scenario.busy) >= BUSY_SAMPLES, scenario.scraped()
    for reading in scenario.busy:
        sample = sample_figures(reading.observation)
        assert UNATTRIBUTED_OWNER not in sample and set(sample) <= {*OWNERS, g.IN_STEP_OWNER}, sample
        assert reading.page.state() == "ok"
        page = reading.page.owners()
        assert set(page) == set(sample) | {g.TRUTHFUL_OWNER, g.UNDER_OWNER, g.NEVER_OWNER}
        peaks = {o.owner: o.peak_bytes for o in reading.observation.owners}
        for owner, figures in page.items():
            assert (figures.observed, figures.caches) == sample.get(owner, (0, 0)), owner
            assert figures.peak == peaks.get(owner, 0) >= figures.observed, owner


def test_each_owner_is_what_it_declares_and_holds(scenario: Scenario) -> None:
    for reading in [*scenario.busy, scenario.idle]:
        page = reading.page.owners()
        page.pop(g.IN_STEP_OWNER, None)  # its own test below
        for owner, figures in page.items():
            assert figures.ceiling == ceiling(owner), owner
            positions = g.REQUEST_POSITIONS.get(owner, g.NEVER_POSITIONS)
            full = figures.caches * cache_bytes(positions)
            if reading is scenario.idle:
                assert figures.observed == full, owner
            else:  # a cache counts from its creation and fills layer by layer (`filled_cache`): a sample taken
                assert figures.observed <= full, owner  # in between sees it partly filled (once: 6 of 7 caches whole)
            assert figures.caches <= MAX_NUM_SEQS
            # Whole layers, not whole caches: the interval's peak starts at what was held at the sample before, which
            # may have caught a cache filled layer by layer (`filled_cache`) half way (57,344 B = 3.5 caches, once).
            layer = cache_bytes(positions) // g.SIDE_LAYERS
            assert figures.peak >= figures.observed and figures.peak % layer == 0, owner
        truthful, under, never = page[g.TRUTHFUL_OWNER], page[g.UNDER_OWNER], page[g.NEVER_OWNER]
        assert truthful.peak <= truthful.ceiling and truthful.unexplained == 0
        assert under.unexplained == max(0, under.peak - under.ceiling)  # the peak since the sample before
        if g.UNDECLARED_OWNER in page:
            assert page[g.UNDECLARED_OWNER].unexplained == page[g.UNDECLARED_OWNER].peak
        assert (never.observed, never.caches, never.peak, never.unexplained) == (0, 0, 0, 0)
    held = [r.page.owners()[g.TRUTHFUL_OWNER] for r in scenario.busy]
    whole = cache_bytes(g.REQUEST_POSITIONS[g.TRUTHFUL_OWNER])
    assert any(f.caches and f.observed == f.caches * whole for f in held), held  # the usual sample: every cache whole


def test_the_samples_are_what_the_model_held_to_the_byte(scenario: Scenario) -> None:
    found = comparable(scenario)
    samples = list(distinct_samples(scenario.busy))
    # A change takes well under a millisecond and a sample about one, a second apart: most samples overlap none.
    assert len(found) >= len(samples) // 2, f"{len(found)} of {len(samples)} samples overlap no change"
    busy = 0
    for reading, held in found:
        sample = sample_figures(reading.observation)
        for owner in OWNERS:
            assert sample.get(owner, (0, 0)) == held.get(owner, (0, 0)), (owner, reading.observation.taken_at)
        busy += held[g.UNDER_OWNER][1] >= 2
    assert busy >= BUSY_SAMPLES // 2, f"too few comparable samples with 2 requests or more; {scenario.scraped()}"


def test_idle_every_holder_released_everything(scenario: Scenario) -> None:
    page = scenario.idle.page.owners()
    assert g.UNDECLARED_OWNER not in page  # holding nothing and declaring nothing: not in the sample
    assert {owner: (f.observed, f.caches, f.unexplained) for owner, f in page.items()} == {
        owner: (0, 0, 0) for owner in (g.TRUTHFUL_OWNER, g.UNDER_OWNER, g.NEVER_OWNER)
    }
    assert scenario.log.changes[-1].owners == {owner: (0, 0) for owner in HOLDERS}


def test_a_cache_living_only_inside_steps_is_exported_at_its_peak_to_the_byte(scenario: Scenario) -> None:
    """Between two consecutive samples the peak is the most the in-step owner held in any step between them: at least
    the most of the steps that surely ran inside the interval, at most the most of those that may have. Where the
    two agree (under sustained load, most intervals), the page must show exactly that, and unexplained all of it."""
    samples = list(distinct_samples(scenario.busy))
    interval = samples[0].observation.interval_s
    exact = 0
    for before, reading in itertools.pairwise(samples):
        start, now = before.observation, reading.observation
        if now.taken_at - start.taken_at > 1.5 * interval:  # a sample in between was not read
            continue
        window = (start.taken_at + start.duration_s, now.taken_at)
        surely = [peak for b, e, peak in scenario.steps if window[0] < b and e < window[1]]
        maybe = [peak for b, e, peak in scenario.steps if e > start.taken_at and b < now.taken_at + now.duration_s]
        figures = reading.page.owners().get(g.IN_STEP_OWNER)
        peak = 0 if figures is None else figures.peak
        assert max(surely, default=0) <= peak <= max(maybe, default=0), (start.taken_at, now.taken_at)
        if figures is not None:
            assert figures.unexplained == figures.peak and figures.ceiling == 0
        if surely and max(surely) == max(maybe):
            assert peak == max(surely)
            exact += 1
    # Two pinned intervals prove "to the byte"; how many of them there are depends on the machine's load.
    assert exact >= 2, f"only {exact} intervals pinned the peak to the byte; {scenario.scraped()}"
    # Against the geometry: a step with n running requests holds at most 3 x n caches' worth, never more.
    assert max(peak for _, _, peak in scenario.steps) <= 3 * MAX_NUM_SEQS * cache_bytes(g.STEP_POSITIONS)


def test_a_stopped_sampler_is_stale_and_shows_no_figures(scenario: Scenario) -> None:
    assert scenario.stopped.state() == "stale"
    assert scenario.stopped.owners() == {}
    assert scenario.resumed.state() == "ok"
    assert set(scenario.resumed.owners()) >= {g.TRUTHFUL_OWNER, g.UNDER_OWNER, g.NEVER_OWNER}


def busiest(scenario: Scenario) -> Reading:
    """The comparable sample holding the most requests' caches (the first of them), on a page showing requests
    running (the engine's count, read at the scrape)."""
    running = [reading for reading, _ in comparable(scenario) if reading.page.running() > 0]
    return max(running, key=lambda r: r.page.owners()[g.UNDER_OWNER].caches)


def signature(text: str) -> set[tuple[str, tuple[tuple[str, str], ...]]]:
    """A recorded page's series of the observed and declared families, with the states that are 1: what must still
    be there when the page is recorded again (the figures under load differ from run to run)."""
    keep = ("model_local_kv_observed", "model_local_kv_unexplained", "model_local_kv_ceiling", "model_local_kv_running")
    samples = parse(text)
    found = {(name, labels) for (name, labels), _ in samples.items() if name.startswith(keep)}
    states = {(name, labels) for (name, labels), v in samples.items() if name.endswith("observation_state") and v}
    return found | states


def test_recorded_pages(scenario: Scenario) -> None:
    if not scenario.eager:
        pytest.skip("the recorded pages are the --enforce-eager engine's")
    pages = {
        "under-load.prom": busiest(scenario).page.text,
        "idle.prom": scenario.idle.page.text,
        "sampler-stopped.prom": scenario.stopped.text,
    }
    under = busiest(scenario).page.owners()
    assert under[g.UNDER_OWNER].caches >= 2 and under[g.UNDECLARED_OWNER].observed > 0
    assert under[g.IN_STEP_OWNER].peak > 0  # its caches live inside steps: the peak shows them
    RECORDED.mkdir(exist_ok=True)
    for name, text in pages.items():
        path = RECORDED / name
        if not path.exists() or os.environ.get(UPDATE_FIXTURES_ENV) == "1":
            path.write_text(text)
        assert signature(text) == signature(path.read_text()), f"{path} no longer describes what the sidecar serves"
