"""One harness for every training recipe on Ray Train (retriever, generator).

Driver side, `fit`: sizes a `TorchTrainer` (scaling, gloo/NCCL, `FailureConfig`, storage under the run folder, the
Tune callback, the worker environment) and returns the fit's final checkpoint. Worker side, `Worker`: the recipe's
view of its process -- rank, world, device, threads, seeding, checkpoint save/restore, fault injection, the rank-0
metric sink and the log window. A recipe then reads set-up -> step -> evaluate -> save, and never touches Ray Train.

Workers receive a typed `WorkerArgs` (the resolved `Config` plus the stage's typed inputs), never a Hydra config.
"""

from __future__ import annotations

import json
import math
import signal
import tempfile
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import torch
from torch import nn

from ragtrain.cluster.resources import WORKER_ENV, record_placement_group
from ragtrain.config import Config
from ragtrain.config.logger import auth_env
from ragtrain.runtime.console import (
    FILE_ONLY,
    attach_run_log,
    detach_run_log,
    get_logger,
    is_quiet,
    progress_bars,
    quiet_env,
    worker_setup,
)
from ragtrain.track.mlflow import MetricSink
from ragtrain.train.checkpoint import (
    maybe_inject_fault,
    restore_in_worker,
    resume_point,
    save_train_state,
)

log = get_logger(__name__)


def total_steps(max_steps: int, epochs: float, num_examples: int, global_batch: int) -> int:
    """Optimizer steps of a fit: `max_steps` if > 0, else epochs x FULL global batches per epoch (rounded up).

    Both recipes count the same way: the last partial batch of an epoch is dropped, so every step has one size.
    """
    if max_steps > 0:
        return max_steps
    if num_examples < global_batch:
        raise ValueError(
            f"{num_examples} training examples < one global batch of {global_batch} "
            "(batch_size x num_workers): lower the batch size"
        )
    return max(1, math.ceil(epochs * (num_examples // global_batch)))


@dataclass
class WorkerArgs:
    """Everything one worker of a fit receives: typed and resolved on the driver; large data as object refs."""

    cfg: Config
    stage: str  # "retriever" | "generator": names the Ray Train run folder, log lines and fault markers
    cpus_per_worker: float
    fit_id: str = field(default_factory=lambda: uuid.uuid4().hex)  # tags this fit's checkpoints (restart scans)
    resume_from: str | None = None  # resume=true: the run's latest complete checkpoint
    sink: MetricSink | None = None  # rank 0 logs through it into the driver's MLflow run
    report_intermediate: bool = False  # Tune trials: every log window goes to ray.train.report
    # the stage's inputs, a dataclass of its own (RetrieverInputs, GenInputs, TeacherInputs): large data as object
    # refs (`Worker.fetch` resolves them on the worker), services as actor handles
    inputs: Any = None

    def storage(self) -> Path:
        """This stage's Ray Train run folder (its checkpoints) under the run's output folder."""
        return storage_dir(self.cfg, self.stage)


def storage_dir(cfg: Config, stage: str) -> Path:
    """`<output_dir>/ray/<stage>`: where a stage's checkpoints live."""
    return Path(cfg.output_dir, "ray", stage)


class Worker:
    """The recipe's handle on its Ray Train worker process (one per rank)."""

    def __init__(self, args: WorkerArgs, seed: int):
        # lazy: ray is heavy (~0.5 s); this module imports without it
        import ray
        import ray.train
        import ray.train.torch

        self.args, self.cfg, self.stage = args, args.cfg, args.stage
        torch.set_num_threads(max(1, int(args.cpus_per_worker)))
        ctx = ray.train.get_context()
        self.rank, self.world = ctx.get_world_rank(), ctx.get_world_size()
        self.device = ray.train.torch.get_device()
        if self.rank == 0:  # Ray Train's worker group: a sweep removes it if this trial is stopped (cluster/resources)
            record_placement_group(self.cfg.output_dir, ray.util.get_current_placement_group())
        # Dropout draws from torch's default generator: the recipe chooses per-rank or shared seeds; a restart then
        # restores the checkpoint's RNG state over this.
        torch.manual_seed(seed)
        self.sink: MetricSink | None = args.sink if self.rank == 0 else None
        self.measure_s = 0.0  # seconds spent outside training steps (logging, checkpoints, probes)
        self._window_start = time.perf_counter()
        self._bar: Any = None  # rank 0's progress bar (tqdm_ray), made at the first finished step

    def fetch(self, value: Any) -> Any:
        """One of the stage's inputs: an object ref is fetched from the object store, anything else (an actor
        handle, a small dataclass, None) is returned as is."""
        import ray  # lazy: ray is heavy (~0.5 s); this module imports without it

        return ray.get(value) if isinstance(value, ray.ObjectRef) else value

    def restore(self, model: nn.Module, optim: torch.optim.Optimizer, sched: Any) -> tuple[int, dict[str, Any]]:
        """Continue from this fit's latest checkpoint (a restart) or the resumed run's; returns (first step, extra).

        Call it after the model, optimizer and schedule exist; a sync strategy loads its own state after it (an
        async server's anchor, averaging buffers must start from the restored weights, not the initial ones)."""
        step, extra, self.sink = restore_in_worker(
            self.args.storage(),
            {"fit_id": self.args.fit_id, "resume_from": self.args.resume_from},
            self.rank,
            self.world,
            model,
            optim,
            sched,
            self.sink,
            self.stage,
        )
        if self.sink is not None:
            self.sink.warm_up()  # before step 0: other ranks would otherwise wait ~2.5 s at the first collective
        return step, extra

    @contextmanager
    def not_training(self) -> Iterator[None]:
        """Time spent inside is not training throughput (logging, probes, checkpoints): kept out of the window."""
        t0 = time.perf_counter()
        try:
            yield
        finally:
            spent = time.perf_counter() - t0
            self.measure_s += spent
            self._window_start += spent

    def window_seconds(self, restart: bool = True) -> float:
        """Training seconds since the log window started (time inside `not_training` excluded)."""
        now = time.perf_counter()
        elapsed = now - self._window_start
        if restart:
            self._window_start = now
        return elapsed

    def log(self, metrics: dict[str, float], step: int, steps: int, report: bool = False) -> None:
        """Rank 0 prints and logs to MLflow; with `report` (Tune trials) every rank reports (a Train V2 barrier)."""
        import ray.train  # lazy: ray is heavy (~0.5 s); this module imports without it

        with self.not_training():
            if self.rank == 0:
                # With a progress bar the bar shows progress and loss; the full line goes to ragtrain.log
                log.info(
                    f"[{self.stage}] step {step}/{steps} " + " ".join(f"{k}={v:.4g}" for k, v in metrics.items()),
                    extra=FILE_ONLY if progress_bars() else None,
                )
                loss = next((v for k, v in metrics.items() if k.endswith("/loss")), None)
                if self._bar is not None and loss is not None:
                    self._bar.set_description(f"[{self.stage}] loss {loss:.4f}")
                if self.sink is not None:
                    self.sink.log(metrics, step)
            if report and self.args.report_intermediate:
                ray.train.report({"step": step, **metrics})

    def checkpoint(
        self,
        step: int,
        model: nn.Module,
        optim: torch.optim.Optimizer,
        sched: Any,
        extra: dict[str, Any],
        metrics: dict[str, float] | None = None,
        info: dict[str, Any] | None = None,
    ) -> None:
        """Every rank writes its part of the step-`step` checkpoint; Ray Train merges them into one folder (`info`:
        rank 0's plain values for meta.json)."""
        import ray.train  # lazy: ray is heavy (~0.5 s); this module imports without it

        with self.not_training(), tempfile.TemporaryDirectory() as d:
            save_train_state(d, self.rank, self.world, step, model, optim, sched, extra, self.args.fit_id, info)
            ray.train.report({"step": step, **(metrics or {})}, checkpoint=ray.train.Checkpoint.from_directory(d))

    def end_step(self, done: int, steps: int) -> None:
        """After each training step: rank 0's progress bar moves (`console.progress_bars`), then any injected fault
        fires."""
        if self.rank == 0 and progress_bars():
            if self._bar is None:  # drawn by the driver (Ray's tqdm_ray), one bar per stage
                # lazy: ray is heavy (~0.5 s); this module imports without it
                from ray.experimental.tqdm_ray import tqdm

                self._bar = tqdm(desc=f"[{self.stage}] training", total=steps, unit="step")
            self._bar.update(done - self._bar.n)  # from the first step of this attempt (a restart starts later)
            if done == steps:
                self._bar.close()
        self.fault(done)

    def fault(self, step: int) -> None:
        """fault.kill_worker_at_step: this process dies once, as in a crash (tests of restarts)."""
        f = self.cfg.fault
        maybe_inject_fault(f.kill_worker_at_step, f.kill_rank, self.cfg.output_dir, self.stage, self.rank, step)

    def finish(self, summary: dict[str, Any], write: Callable[[Path], None]) -> None:
        """The final report: rank 0 calls `write(folder)` to fill the final checkpoint, marked final with the
        summary (a resumed run that finds it takes its results instead of training again); every rank reports."""
        import ray.train  # lazy: ray is heavy (~0.5 s); this module imports without it

        with tempfile.TemporaryDirectory() as d:
            ckpt = None
            if self.rank == 0:
                write(Path(d))
                meta = {
                    "step": summary["step"],
                    "world": self.world,
                    "final": True,
                    "fit_id": self.args.fit_id,
                    "summary": summary,
                }
                meta_path = Path(d, "meta.json")
                if meta_path.exists():  # the recipe added fields (e.g. the weights file name)
                    meta = {**json.loads(meta_path.read_text()), **meta}
                meta_path.write_text(json.dumps(meta, indent=1))
                ckpt = ray.train.Checkpoint.from_directory(d)
            ray.train.report(summary, checkpoint=ckpt)


def _entry(config: dict[str, Any]) -> None:
    """The worker entry point: Train V2 hands workers a dict; the recipe gets its typed arguments."""
    import ray.train  # lazy: ray is heavy (~0.5 s); this module imports without it

    worker_setup()  # Ray Train's per-report INFO lines stay out of the console unless -v
    args: WorkerArgs = config["args"]
    # Rank 0's lines (the step lines, resume notes) also go into the run's ragtrain.log, next to the driver's: on
    # the driver's node appends of whole lines do not interleave. From another node (a network filesystem, where
    # appends of two machines may) they go to a file of their own beside it.
    run_log = None
    if ray.train.get_context().get_world_rank() == 0 and Path(args.cfg.output_dir).is_dir():
        same_node = config.get("driver_node") in (None, ray.get_runtime_context().get_node_id())
        run_log = attach_run_log(
            args.cfg.output_dir,
            who=f"{args.stage} rank 0",
            name="ragtrain.log" if same_node else f"ragtrain.{args.stage}-rank0.log",
        )
    try:
        config["loop"](args)
    finally:
        if run_log is not None:
            detach_run_log(run_log)


@dataclass
class Fitted:
    """A finished fit: its final checkpoint folder and rank 0's summary."""

    folder: Path
    summary: dict[str, Any]
    checkpoint_path: str
    seconds: float
    resumed_final: bool  # the stage had finished before (resume=true): nothing was trained


def resume_or_none(cfg: Config, stage: str) -> tuple[Path | None, dict[str, Any]]:
    """resume=true: the stage's latest complete checkpoint and its meta; otherwise (None, {})."""
    return resume_point(storage_dir(cfg, stage), cfg.resume)


def fit(
    loop: Callable[[WorkerArgs], None], args: WorkerArgs, num_workers: int, callbacks: list | None = None
) -> Fitted:
    """Driver: run `loop(args)` on `num_workers` Ray Train workers and return the final checkpoint (copied locally).

    Workers get the absolute output folder (checkpoint scans and fault markers must not depend on their cwd).
    A stage that had finished before (resume=true finds a final checkpoint) is not trained again.
    """
    # lazy: ragtrain.train.process_group imports pandas/pyarrow/ray; this module imports without them
    from ragtrain.train.process_group import rendezvous_folder

    cfg = replace(args.cfg, output_dir=str(Path(args.cfg.output_dir).resolve()))
    args = replace(args, cfg=cfg)
    start = time.perf_counter()
    start_from, meta = resume_or_none(cfg, args.stage)
    if start_from is not None and meta.get("final"):
        log.info(f"[{args.stage}] resume: the stage finished before ({start_from}); using its results")
        return Fitted(start_from, meta["summary"], str(start_from), 0.0, True)
    if start_from is not None:
        log.info(f"[{args.stage}] resume from step {meta['step']}: {start_from}")
        args = replace(args, resume_from=str(start_from))
    with rendezvous_folder() as store_folder:  # removed when the fit ends, failed or not
        return _fit(loop, args, num_workers, callbacks, store_folder, start)


INTERRUPTED = "training interrupted (Ctrl+C); its last checkpoint is kept: continue the run with resume=true"


def interruptible(trainer_cls: type) -> type:
    """`trainer_cls` (a Ray Train trainer) whose Ctrl+C ends `fit` as KeyboardInterrupt.

    Ray Train's fit installs a SIGINT handler that aborts the run's controller and then exits with `sys.exit`,
    and leaves it installed: the run would end as a bare SystemExit whose cause nobody sees. This one notes the
    Ctrl+C beside Ray's handler (which still aborts the controller), and `interrupt_as_keyboard` turns the end of
    such a fit into KeyboardInterrupt and restores the handler the driver had."""

    class Interruptible(trainer_cls):
        interrupted = False

        def _register_sigint_handler(self, controller: Any) -> None:
            super()._register_sigint_handler(controller)
            ray_handler = signal.getsignal(signal.SIGINT)

            def note_then_abort(signum: int, frame: Any) -> None:
                self.interrupted = True
                if callable(ray_handler):  # Ray's: it aborts the run's controller
                    ray_handler(signum, frame)

            signal.signal(signal.SIGINT, note_then_abort)

        @contextmanager
        def interrupt_as_keyboard(self) -> Iterator[None]:
            if threading.current_thread() is not threading.main_thread():  # a Tune trial: Tune owns Ctrl+C
                yield
                return
            before = signal.getsignal(signal.SIGINT)
            try:
                yield
            except SystemExit:
                if self.interrupted:
                    raise KeyboardInterrupt(INTERRUPTED) from None
                raise
            finally:
                signal.signal(signal.SIGINT, before)
            if self.interrupted:  # aborted, and Ray returned instead of exiting
                raise KeyboardInterrupt(INTERRUPTED)

    return Interruptible


def _fit(
    loop: Callable[[WorkerArgs], None],
    args: WorkerArgs,
    num_workers: int,
    callbacks: list | None,
    store_folder: str,
    start: float,
) -> Fitted:
    """`fit`'s Ray Train run, its process group's rendezvous files in `store_folder`."""
    # lazy: ray is heavy (~0.5 s); this module imports without it
    import ray
    from ray.train import CheckpointConfig, FailureConfig, LoggingConfig, RunConfig, ScalingConfig
    from ray.train.torch import TorchTrainer

    # lazy: ragtrain.train.process_group imports pandas/pyarrow/ray; this module imports without them
    from ragtrain.train.process_group import LoopbackTorchConfig

    cfg = args.cfg
    r = cfg.resources.trainer
    trainer = interruptible(TorchTrainer)(
        _entry,
        train_loop_config={"loop": loop, "args": args, "driver_node": ray.get_runtime_context().get_node_id()},
        torch_config=LoopbackTorchConfig(backend="nccl" if r.use_gpu else "gloo", store_folder=store_folder),
        scaling_config=ScalingConfig(
            num_workers=num_workers,
            use_gpu=r.use_gpu,
            resources_per_worker={
                "CPU": args.cpus_per_worker,
                **({"GPU": r.gpus_per_worker} if r.use_gpu else {}),
                **r.resources,
            },
        ),
        run_config=RunConfig(
            name=args.stage,
            storage_path=str(args.storage().parent),
            checkpoint_config=CheckpointConfig(num_to_keep=cfg.checkpoint.keep),
            failure_config=FailureConfig(max_failures=cfg.fault.max_failures),
            callbacks=callbacks or None,
            worker_runtime_env={"env_vars": {**WORKER_ENV, **quiet_env(), **auth_env()}},
            # Ray Train's controller and workers configure their own loggers (worker-group start, process group
            # set-up): under ragtrain's quiet console they print warnings and errors only; -v shows the rest
            logging_config=LoggingConfig(log_level="WARNING" if is_quiet() else "INFO"),
        ),
    )
    with trainer.interrupt_as_keyboard():
        result = trainer.fit()
    if result.checkpoint is None:
        raise RuntimeError(f"{args.stage} training finished without a checkpoint (error: {result.error})")
    # storage_path is a folder of the run (a local or shared filesystem), so the checkpoint is readable in place
    folder = Path(result.checkpoint.path)
    return Fitted(folder, dict(result.metrics), result.checkpoint.path, time.perf_counter() - start, False)
