"""Running calibration tasks in parallel (joblib: loky, threading, dask, ray) and the model they share.

A task gets a :class:`Worker`: the model's spec (to load it in a worker process, once per
process), or the caller's already loaded model when the task runs in the caller's process.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from pathlib import Path

import torch

from adaptive.calibrate.progress import Phase, Progress
from adaptive.calibrate.settings import BACKENDS, CalibrationSettings, calibration_workdir
from adaptive.errors import ConfigError
from adaptive.models import LoadedModel, load_model
from adaptive.workdir import WorkDir

_MODELS: dict[tuple, LoadedModel] = {}  # per worker process: loaded once, reused by its tasks
_MODELS_LOCK = threading.Lock()


def shared_model(spec: str, device: str, dtype: str, weights: str = "dense", engine: str = "auto",
                 threads: int | None = None) -> LoadedModel:
    """Load ``spec`` once per process (the tasks of a pool's worker reuse it)."""
    key = (str(spec), str(device), str(dtype), weights, engine, threads)
    with _MODELS_LOCK:
        if key not in _MODELS:
            _MODELS[key] = load_model(spec, device=device, dtype=dtype, weights=weights, engine=engine, threads=threads)
        return _MODELS[key]


def in_process(jobs: int, backend: str) -> bool:
    """Whether tasks run in the caller's process (and may use its loaded model)."""
    return backend == "threading" or (jobs == 1 and backend == "loky")


@dataclass
class Worker:
    """What every task of one calibration shares: how to get the model, the settings, the work
    directory (``out``: the profile being written), threads per worker, the caller's progress bar
    (``bars``). ``lm`` (an in-process model) is never sent to a worker process: one there loads ``spec``."""

    spec: str
    device: str
    dtype: str
    settings: CalibrationSettings
    out: str
    threads: int | None = None
    lm: LoadedModel | None = field(default=None, compare=False, repr=False)
    weights: str = "dense"
    engine: str = "auto"  # adaptive.models.ENGINES; a worker process loads the model on the caller's engine
    bars: Progress | None = field(default=None, compare=False, repr=False)  # the caller's bar, in its process only

    def __getstate__(self):
        return {**self.__dict__, "lm": None, "bars": None}

    def phase(self, phase: str, task: str, items: int, done: int = 0) -> Phase:
        """A phase of the calibration's overall bar (a silent one in a worker process)."""
        return Phase(self.bars, phase, task, items, done)

    def model(self) -> LoadedModel:
        if self.threads:
            torch.set_num_threads(self.threads)
        return self.lm if self.lm is not None else shared_model(self.spec, self.device, self.dtype, self.weights,
                                                                 self.engine, self.threads)

    @property
    def work(self) -> WorkDir:
        return calibration_workdir(Path(self.out))


def run_parallel(fn, arg_list: list[tuple], jobs: int, backend: str, scheduler: str | None) -> list:
    """Run ``fn(*args)`` for each args tuple with joblib's ``backend``; in-process when ``jobs == 1``."""
    if jobs == 1 and backend in ("loky", "threading"):
        return [fn(*args) for args in arg_list]
    from joblib import Parallel, delayed, parallel_config

    if backend in ("loky", "threading"):
        with parallel_config(backend=backend, n_jobs=jobs):
            return Parallel()(delayed(fn)(*args) for args in arg_list)
    if backend == "dask":
        return _run_dask(fn, arg_list, jobs, scheduler)
    if backend == "ray":
        return _run_ray(fn, arg_list, jobs, scheduler)
    raise ConfigError(f"unknown backend {backend!r}; choose one of {', '.join(BACKENDS)}")


def _run_dask(fn, arg_list: list[tuple], jobs: int, scheduler: str | None) -> list:
    from joblib import Parallel, delayed, parallel_config

    try:
        from dask.distributed import Client, LocalCluster
    except ImportError:
        raise ConfigError("--backend dask needs dask[distributed]: pip install 'adaptive[dask]'") from None
    cluster = None
    if scheduler:
        try:
            client = Client(scheduler, timeout="20s")
        except (OSError, TimeoutError) as exc:
            raise ConfigError(f"cannot reach the dask scheduler at {scheduler}: {exc}") from None
    else:
        cluster = LocalCluster(n_workers=jobs, threads_per_worker=1, processes=True, dashboard_address=None)
        client = Client(cluster)
    try:
        with parallel_config(backend="dask", n_jobs=jobs):
            return Parallel()(delayed(fn)(*args) for args in arg_list)
    finally:
        client.close()
        if cluster is not None:
            cluster.close()


def _run_ray(fn, arg_list: list[tuple], jobs: int, scheduler: str | None) -> list:
    from joblib import Parallel, delayed, parallel_config

    try:
        import ray
        from ray.util.joblib import register_ray
    except ImportError:
        raise ConfigError("--backend ray needs ray: pip install 'adaptive[ray]'") from None
    if not ray.is_initialized():
        ray.init(address=scheduler) if scheduler else ray.init()
    register_ray()
    with parallel_config(backend="ray", n_jobs=jobs):
        return Parallel()(delayed(fn)(*args) for args in arg_list)
