"""Where the runs of a virtual sweep execute (`astro bench --virtual --executor ...`).

A probe is one run of the workload: (in-instance policy, dispatch policy, k, rate) and
the arrival times of that rate. Its result is a pure function of the probe and the
bench config: the arrival times come from a generator seeded by (seed, rate), the
run's own generator (dispatch sampling, prediction noise) by (seed, 11), the workload
and the dispatcher's predicted lengths are computed once before any run, and nothing of
one run carries into the next. So a probe gives the same records in any process, in
any order, and every executor gives the serial run's report.

- `serial`: `run_bench`'s own loop, in this process, one run after another.
- `processes`: a pool of local worker processes (`concurrent.futures`, "spawn": no
  fork of a process that may hold threads); each worker unpickles the prepared target
  once (`VirtualTarget.__getstate__` leaves out the loaded length model and tokenizer
  callables, which the runs do not use or reload by path).
- `ray`: each probe is a Ray task (`num_cpus=1`) on the target put once into the object
  store; `ray_address` joins a running cluster (its nodes need this package and the
  workload's files at the same paths), else a local Ray starts with `workers` CPUs (all
  cores by default) and stops at the end. Ray is the `ray` extra.

`run_bench` hands an executor a whole round of probes (every rate of a `--rates` sweep
for every policy; or the next rates of every policy's capacity search,
`capacity.CapacitySearch`) and puts the results back in the serial run's order.
"""

from __future__ import annotations

import os
import pickle
import time
from collections.abc import Sequence
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass
from typing import Any

from rps_astro_cli.errors import AstroUserError


@dataclass(frozen=True)
class ProbeTask:
    """One run to execute."""

    instance_policy: str | None  # in-instance policy (None: the config's)
    policy: str | None           # dispatch policy
    k: str | None                # power_of_k sample size, as given to --k
    times_s: tuple[float, ...]   # planned arrival time of each workload request (s from the start)


@dataclass(frozen=True)
class ProbeOutcome:
    """What one run gives back."""

    records: list[Any]           # `RequestRecord` per workload request, in workload order
    extras: dict[str, Any]       # the target's extras (preemptions, per-instance counts...)
    wall_s: float                # wall time of the run where it executed (s)


def execute_probe(target: Any, task: ProbeTask) -> ProbeOutcome:
    """Run `task` on `target` (a `VirtualTarget`); every executor runs probes through this."""
    target.use_policy(task.policy, task.k)
    target.use_instance_policy(task.instance_policy)
    t0 = time.perf_counter()
    records, extras = target.run(target.wl.requests, list(task.times_s), lambda r: None)
    return ProbeOutcome(records, extras, time.perf_counter() - t0)


class InProcessExecutor:
    """Runs each probe here, in order (the parallel path's reference; tests use it)."""

    name = "in-process"

    def __init__(self, target: Any):
        self.target = target

    def run(self, tasks: Sequence[ProbeTask]) -> list[ProbeOutcome]:
        return [execute_probe(self.target, t) for t in tasks]

    def close(self) -> None:
        pass


_WORKER_TARGET: Any = None  # the target a pool worker unpickled once (`_init_worker`)


def _init_worker(blob: bytes) -> None:
    global _WORKER_TARGET
    _WORKER_TARGET = pickle.loads(blob)


def _worker_probe(task: ProbeTask) -> ProbeOutcome:
    return execute_probe(_WORKER_TARGET, task)


class ProcessExecutor:
    """A pool of `workers` local processes (default: the CPU count)."""

    name = "processes"

    def __init__(self, target: Any, workers: int | None = None):
        import multiprocessing

        self.workers = workers or os.cpu_count() or 1
        blob = pickle.dumps(target)
        self.pool = ProcessPoolExecutor(max_workers=self.workers, mp_context=multiprocessing.get_context("spawn"),
                                        initializer=_init_worker, initargs=(blob,))

    def run(self, tasks: Sequence[ProbeTask]) -> list[ProbeOutcome]:
        return list(self.pool.map(_worker_probe, tasks))

    def close(self) -> None:
        self.pool.shutdown(wait=True, cancel_futures=True)


def import_ray() -> Any:
    """`import ray`, or the one-line user error saying how to install it.

    Raises:
        AstroUserError: field "--executor" — ray is not installed.
    """
    try:
        import ray
    except ImportError:
        raise AstroUserError("--executor ray needs Ray, which is not installed", field="--executor",
                             fix="pip install 'rps_astro_cli[ray]' (or pip install ray), or use --executor "
                                 "processes / serial") from None
    return ray


class RayExecutor:
    """Each probe a Ray task (module docstring)."""

    name = "ray"

    def __init__(self, target: Any, address: str | None = None, workers: int | None = None):
        ray = import_ray()
        self.ray = ray
        self.started = False
        if not ray.is_initialized():
            kw: dict[str, Any] = {"include_dashboard": False, "logging_level": "ERROR", "log_to_driver": False,
                                  "configure_logging": True}
            try:
                if address:
                    ray.init(address=address, **kw)
                else:
                    ray.init(num_cpus=workers or os.cpu_count() or 1, **kw)
            except (ConnectionError, ValueError, RuntimeError) as exc:
                first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
                raise AstroUserError(f"cannot start or join Ray ({first})",
                                     field="--ray-address" if address else "--executor",
                                     fix="check the address (ray status on the head node), or drop --ray-address "
                                         "to start a local Ray") from None
            self.started = True
        self.workers = int(ray.cluster_resources().get("CPU", 1))
        self.target_ref = ray.put(target)
        self.remote = ray.remote(num_cpus=1, max_retries=0)(execute_probe)

    def run(self, tasks: Sequence[ProbeTask]) -> list[ProbeOutcome]:
        refs = [self.remote.remote(self.target_ref, t) for t in tasks]
        try:
            return list(self.ray.get(refs))
        except KeyboardInterrupt:
            for r in refs:
                self.ray.cancel(r, force=True)
            raise

    def close(self) -> None:
        if self.started:
            self.ray.shutdown()


def make_executor(execution: Any, target: Any) -> Any:
    """The executor of `execution` (`config.ExecutionSection`) for a parallel sweep on
    `target`; "serial" is `run_bench`'s own loop and has none.

    Raises:
        AstroUserError: ray asked for but not installed, or it cannot start / join.
    """
    if execution.executor == "ray":
        return RayExecutor(target, execution.ray_address, execution.workers)
    if execution.executor == "processes":
        return ProcessExecutor(target, execution.workers)
    raise ValueError(f"no parallel executor for {execution.executor!r}")


__all__ = ["InProcessExecutor", "ProbeOutcome", "ProbeTask", "ProcessExecutor", "RayExecutor", "execute_probe",
           "import_ray", "make_executor"]
