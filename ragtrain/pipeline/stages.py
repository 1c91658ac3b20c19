"""run(cfg): load data -> (zero-shot index + eval) -> retriever training -> index build + eval -> MLflow summary."""

from __future__ import annotations

import contextlib
import functools
import json
import os
import shutil
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Protocol

import torch
from omegaconf import OmegaConf
from tabulate import tabulate

from ragtrain.cluster.resources import check_config, init_ray, trains_with_live_refresh
from ragtrain.cluster.storage import check_shared_paths, shared_paths
from ragtrain.config import Config, absolute_paths, changed_keys, flatten, ineffective_settings, to_flat_dict
from ragtrain.config.logger import LoggerBackend
from ragtrain.corpus.load import load_data, truncation_report
from ragtrain.corpus.stream import StreamEncode
from ragtrain.data import RetrievalData
from ragtrain.data.types import DataError
from ragtrain.embed.encoders import EncodeFault, encoder_dim
from ragtrain.embed.model import build_encoder, check_model_offline
from ragtrain.embed.precision import resolved_index, resolved_params
from ragtrain.index import vector_cache
from ragtrain.index.base import Index
from ragtrain.index.checks import check_refresh, refresh_warnings
from ragtrain.index.faiss_index import check_index_config, check_index_device
from ragtrain.index.vector_files import save_atomic
from ragtrain.index.vector_ops import DRIFT_SAMPLE, drift, sample_ids
from ragtrain.pipeline.export import answer_block, export_run
from ragtrain.pipeline.retrieval import BuiltIndex, Retrieval
from ragtrain.repair.distill import distill_consensus
from ragtrain.reranker.model import check_teacher
from ragtrain.reranker.stage import prepare_teacher
from ragtrain.retriever.lora import check_lora_targets
from ragtrain.retriever.stage import RetrieverRun, check_train_batch, first_index_is_zeroshot, run_retriever_stage
from ragtrain.runtime import run_lock
from ragtrain.runtime.console import attach_run_log, collect_log_lines, detach_run_log, get_logger, replay
from ragtrain.runtime.errors import ConfigError
from ragtrain.track.mlflow import RunLogger, check_tracking_uri, open_client, redact_uri, store_folder, tracking_uri

log = get_logger(__name__)


def prepare_output_dir(path: str, key: str = "output_dir") -> Path:
    """Create the run's output folder (or another folder the run writes, named by its config `key`), failing early
    (before any work) if it cannot be written."""
    out = Path(path)
    try:
        out.mkdir(parents=True, exist_ok=True)
        probe = out / ".write_test"
        probe.write_text("ok")
        probe.unlink()
    except OSError as e:
        raise ConfigError(f"{key}={str(out)!r} is not writable ({e.strerror}): choose another {key}") from None
    return out


@contextlib.contextmanager
def undo_on_failure(*folders: str | None) -> Iterator[None]:
    """On an exception, remove what the block created in `folders` (entries that were not there before, and a
    folder it created that is left empty): a run that failed its checks leaves nothing half-written behind."""
    before: dict[Path, set[str] | None] = {}
    existed: set[Path] = set()  # the folders' ancestors that were there before (the others the block made)
    for f in folders:
        if f:
            p = Path(f).resolve()
            before[p] = {e.name for e in p.iterdir()} if p.is_dir() else None
            existed |= {a for a in p.parents if a.exists()}
    try:
        yield
    except BaseException:
        for p, had in before.items():
            if not p.is_dir():
                continue
            for e in p.iterdir():
                if had is not None and e.name in had:
                    continue  # it was there before this run
                if e.is_dir() and not e.is_symlink():
                    shutil.rmtree(e)
                else:
                    e.unlink()
            if had is None and not any(p.iterdir()):
                p.rmdir()
                for parent in p.parents:  # and the empty parents made for it (mkdir parents=True)
                    if parent in existed or not parent.is_dir() or any(parent.iterdir()):
                        break
                    parent.rmdir()
        raise


STATUS_FILE = "status.json"  # {"status": running | failed | complete, ...}: what a run folder holds


def write_status(out: Path, status: str, **extra) -> None:
    """Mark the run folder: "running" once every check has passed (config.yaml is written then), then
    "complete" or "failed" (with the error)."""
    tmp = out / f".{STATUS_FILE}.tmp"
    tmp.write_text(json.dumps({"status": status, "time": time.strftime("%Y-%m-%dT%H:%M:%S%z"), **extra}))
    tmp.replace(out / STATUS_FILE)


def read_status(out: Path) -> str | None:
    """The status a run folder's status.json records; None without one (a folder written before it existed),
    "unknown" when it cannot be read."""
    path = out / STATUS_FILE
    if not path.is_file():
        return None
    try:
        return str(json.loads(path.read_text()).get("status"))
    except (OSError, ValueError, AttributeError):
        return "unknown"


def completed(out: Path) -> bool:
    """Whether the run folder `out` holds a run that finished (status complete, its results saved)."""
    return read_status(out) == "complete" and (out / "metrics.json").is_file()


def finished_results(cfg: Config) -> dict[str, dict[str, float]] | None:
    """resume=true on a run that completed: its saved results (metrics.json), with nothing run, rewritten or
    logged again; None for any other folder. The config must still be the one the run was started with."""
    out = Path(cfg.output_dir)
    if not (cfg.resume and completed(out)):
        return None
    saved = out / "metrics.json"
    run_lock.check_owner(cfg.output_dir)
    check_resume(cfg, out)
    log.info(f"[resume] the run in {out} finished before: nothing to run; its results are {saved}")
    return json.loads(saved.read_text())


# Keys that may differ between a run and its resumption without a word: the resume switch itself
RESUME_IGNORED = ("resume", "resume_allow_changes")


def check_resume(cfg: Config, out: Path) -> None:
    """resume=true continues the run in output_dir only with the config it was started with: the differing keys
    are named (resume_allow_changes=[key, ...] accepts those keys, or whole groups such as `fault`)."""
    saved_file = out / "config.yaml"
    if not saved_file.exists():
        raise ConfigError(
            f"resume=true but output_dir={str(out)!r} holds no earlier run (no config.yaml): "
            "point output_dir at the interrupted run's folder"
        )

    saved = absolute_paths(flatten(OmegaConf.to_container(OmegaConf.load(saved_file))))  # older runs: paths as typed
    now = flatten(OmegaConf.to_container(OmegaConf.structured(cfg), enum_to_str=True))
    unknown = [k for k in cfg.resume_allow_changes if not any(n == k or n.startswith(k + ".") for n in now)]
    if unknown:
        raise ConfigError(
            f"resume_allow_changes names {unknown}, which are not config keys or groups (e.g. "
            "retriever.train.max_steps, fault): check their spelling"
        )
    differ = changed_keys(saved, now, tuple(RESUME_IGNORED) + tuple(cfg.resume_allow_changes))
    if differ:
        shown = "; ".join(f"{k}: {saved.get(k, '<unset>')} -> {now.get(k, '<unset>')}" for k in differ[:8])
        more = f" (and {len(differ) - 8} more)" if len(differ) > 8 else ""
        raise ConfigError(
            f"resume=true: the run in {saved_file} was started with another config ({shown}{more}); "
            "resume with its config, or accept these keys with resume_allow_changes=[...]"
        )
    run_file = out / "mlflow_run_id"
    run_id = run_file.read_text().strip() if run_file.exists() else ""
    if cfg.logger.backend == LoggerBackend.mlflow and run_id:  # the run it continues must be in this store
        uri = tracking_uri(cfg.logger)
        try:
            open_client(uri).get_run(run_id)
        except Exception as e:  # MlflowException (RESOURCE_DOES_NOT_EXIST), or a store that cannot answer
            raise ConfigError(
                f"resume=true: the MLflow run {run_id} of {out} ({run_file}) is not in "
                f"logger.tracking_uri={redact_uri(uri)!r} ({str(e).splitlines()[0][:120]}): resume "
                "with the tracking store the run was logged to"
            ) from None


def check_fresh_output(cfg: Config) -> None:
    """Without resume, a folder that holds a finished (or running) run is not written over: its metrics, index and
    exports would be replaced without a word. overwrite=true allows it; a failed run's folder may be reused."""
    path = Path(cfg.output_dir) / STATUS_FILE
    status = read_status(path.parent)
    if cfg.resume or cfg.overwrite or status is None:
        return
    if status != "failed":
        raise ConfigError(
            f"output_dir={cfg.output_dir!r} holds a {status} run ({path}): a new run would replace "
            "its results; choose another output_dir, continue it with resume=true, or replace it with "
            "overwrite=true"
        )


def check_qrels(data: RetrievalData) -> None:
    """A query set whose judgements are all grade 0 would train on nothing or score 0 everywhere: fail now."""
    for what, qrels in (("evaluated (" + data.split + ")", data.eval_qrels), ("training", data.train_qrels)):
        if qrels and not any(g > 0 for judged in qrels.values() for g in judged.values()):
            raise DataError(
                f"{data.name}: every qrel of the {what} queries has grade 0 (no relevant passage); "
                "relevant passages need grade >= 1 in qrels/<split>.tsv"
            )


def write_timeline(out: Path, logger) -> Path:
    """profile=true: Ray's Chrome-trace timeline of this run's tasks and actor calls, into the output folder and
    the MLflow run."""
    import ray  # lazy: ray is heavy (~0.5 s); this module imports without it

    path = out / "ray_timeline.json"
    ray.timeline(filename=str(path))
    logger.log_artifact(path)
    log.info(f"[profile] Ray timeline: {path} (chrome://tracing or https://ui.perfetto.dev)")
    return path


def summary_table(results: dict[str, dict[str, float]]) -> str:
    """Metrics side by side per phase (zero-shot, trained, ...), with trained - zero-shot."""
    phases = [p for p in results if p != "train" and not p.startswith(("gen_", "joint"))]  # retrieval phases only
    if not phases:
        return "(no retrieval phases)"
    keys = [k for k in results[phases[0]] if "@" in k]
    change = "zeroshot" in results and "trained" in results
    rows = []
    for k in keys:
        row = [k] + [results[p].get(k, float("nan")) for p in phases]
        if change:
            row.append(results["trained"].get(k, float("nan")) - results["zeroshot"].get(k, float("nan")))
        rows.append(row)
    headers = ["metric"] + phases + (["trained - zeroshot"] if change else [])
    return tabulate(rows, headers=headers, floatfmt=".4f")


def initial_weights(cfg: Config) -> dict[str, torch.Tensor]:
    """The retriever's weights before training (the tiny encoder's init is seeded; pretrained weights ignore it)."""
    torch.manual_seed(cfg.seed)
    encoder = build_encoder(cfg.retriever)
    return {k: v.detach().clone() for k, v in encoder.state_dict().items()}


def stream_encode(cfg: Config, out: Path, weights: Callable[[], dict[str, torch.Tensor]]):
    """The zero-shot encode of `weights()`, to run inside the corpus stream of a documents folder prepared on Ray
    (None when the first index is not zero-shot, or with index.cache_dir: a cache hit needs the corpus fingerprint
    first)."""
    if not first_index_is_zeroshot(cfg) or cfg.index.cache_dir:
        return None
    vec_dir = out.resolve() / "vectors"
    fault = None
    if cfg.fault.kill_encode_actor_at_batch >= 0:  # fault injection (tests): one encode actor dies, once per run
        vec_dir.mkdir(parents=True, exist_ok=True)
        fault = EncodeFault(cfg.fault.kill_encode_actor_at_batch, str(vec_dir / ".encode_actor_killed"))

    def key(weights: dict, fingerprint: str) -> str:  # called once Ray is up: auto resolved for the encode actors
        return vector_cache.cache_key(
            weights, cfg.retriever, resolved_index(cfg), fingerprint, cfg.retriever.passage_max_length
        )

    def precheck(data: RetrievalData, passages: int) -> None:  # the stream's first pass, before it encodes
        # lazy: ragtrain.index.sharded imports faiss/ray; this module imports without them
        from ragtrain.index.sharded import check_shard_config

        check_qrels(data)
        if not cfg.data.chunk.enabled:  # chunked, the training examples are counted on chunks: after the stream
            check_train_batch(cfg, data)
        check_index_config(cfg.index.factory, encoder_dim(cfg.retriever), passages)
        nodes = ray_nodes() if cfg.index.shards == "auto" else None  # Ray is up here
        check_shard_config(cfg.index, cfg.refresh, encoder_dim(cfg.retriever), passages, nodes, fault is not None)

    return StreamEncode(
        weights=weights,
        index=cfg.index,
        pool=cfg.resources.pool,
        folder=vec_dir / "zeroshot",
        fault=fault,
        key=key,
        precheck=precheck,
    )


def preflight_checks(cfg: Config, out: Path, weights: Callable[[], dict[str, torch.Tensor]]) -> RetrievalData:
    """Every check that needs no training, in order of cost; returns the loaded (and stored) data. `weights()`: the
    initial weights, called only when the corpus stream encodes the zero-shot index."""
    # lazy: ragtrain.index.sharded imports faiss/ray; this module imports without them
    from ragtrain.index.sharded import check_shard_config, shard_gpu_claim

    check_refresh(cfg.refresh, fault=cfg.fault)  # the variant names, against their registries (and the fault hooks)
    for line in ineffective_settings(cfg) + refresh_warnings(cfg.refresh):
        log.warning(line)
    if cfg.logger.backend == LoggerBackend.mlflow:  # a store that cannot work fails in seconds, not after training
        check_tracking_uri(tracking_uri(cfg.logger))
    if cfg.resume:  # before anything in the folder is touched (the store it was logged to is asked too)
        check_resume(cfg, out)
    check_model_offline(cfg.retriever)
    if "retriever" in cfg.stages:
        check_lora_targets(cfg.retriever)
    if cfg.retriever.teacher.weight > 0 and cfg.retriever.teacher.path:  # a teacher for another tokenizer: now
        check_teacher(cfg.retriever.teacher.path, cfg.retriever)

    def start_ray() -> None:  # Ray up, and on several nodes every shared path seen from each, before any Ray work
        if not started:
            init_ray(cfg.resources)
            check_shared_paths(*shared_paths(cfg, out))
            started.append(True)
            # Infeasible requests fail in seconds, not as a pending hang (the corpus stream's actors included); with
            # live refresh the trainer and the pool run at the same time, so they must fit the cluster together.
            # Without retriever training the trainer is not placed.
            check_config(
                cfg.resources,
                together=trains_with_live_refresh(cfg.stages, cfg.refresh.enabled),
                trainer=bool({"retriever", "joint"} & set(cfg.stages)),
                shard_gpus=shard_gpu_claim(cfg.index),
            )

    started: list[bool] = []
    dim = encoder_dim(cfg.retriever)
    check_index_config(cfg.index.factory, dim)  # a factory string FAISS rejects: before reading anything
    check_index_device(cfg.index.device, cfg.index.factory, dim)  # cuda: a GPU FAISS, a GPU, a GPU-capable factory
    # Bad data fails here, before Ray or MLflow start (a corpus prepared on Ray Data: just after Ray starts)
    data = load_data(
        cfg.data,
        cfg.retriever,
        out,
        start_ray=start_ray,
        ray_tasks=cfg.resources.pool.num_actors,
        stream=stream_encode(cfg, out, weights),
    )
    check_qrels(data)
    check_train_batch(cfg, data)
    if not cfg.data.chunk.enabled and cfg.data.source_reads_files:  # generated passages are one fact each
        report = truncation_report(data.corpus, cfg.retriever, cfg.seed)
        if report:
            log.warning(report)
    # Also when no zero-shot index is built first: a bad factory must not wait for the end of training to fail
    check_index_config(cfg.index.factory, dim, len(data.corpus))
    fault = cfg.fault.kill_encode_actor_at_batch >= 0
    # index.shards: a count now, `auto` once Ray is up (below); the live refresh's policy settings
    check_shard_config(cfg.index, cfg.refresh, dim, len(data.corpus), encode_fault=fault)
    if {"generator", "joint"} & set(cfg.stages):  # no answers, a missing or mismatched saved index: fail now
        # lazy: ragtrain.generator.stage imports ray; this module imports without it
        from ragtrain.generator.stage import preflight

        preflight(cfg, data, out)
    log.info(
        f"[data] {data.name}: {len(data.corpus)} passages, {len(data.train_qrels)} train queries, "
        f"{len(data.eval_qrels)} {data.split} queries"
    )
    start_ray()
    if cfg.index.shards == "auto":  # one shard per index node: the live cluster says how many
        check_shard_config(cfg.index, cfg.refresh, dim, len(data.corpus), ray_nodes(), encode_fault=fault)
    return data


def ray_nodes() -> list[dict]:
    """The live cluster's nodes (`index.shards=auto` is one shard per index node)."""
    import ray  # lazy: ray is heavy (~0.5 s); this module imports without it

    return ray.nodes()


@dataclass
class RunState(RetrieverRun):
    """What one run's stages hand each other: the data, the run's folder and MLflow run, the retrieval facade, the
    weights the next stage starts from, and every phase's metrics (RetrieverRun's), this run's index, and what a
    Tune trial passes to the training."""

    built: BuiltIndex | None = None  # this run's index (the `index` stage)
    callbacks: list | None = None  # a Tune trial's TuneReportCallback
    report_intermediate: bool = False  # a Tune trial: ray.train.report at every log window


class Stage(Protocol):
    """One entry of `stages`: runs on the run's state, adds its phases' metrics to `s.results`."""

    def run(self, s: RunState) -> None: ...


class RetrieverStage:
    """The zero-shot index, the bi-encoder's training, its saved weights (ragtrain/retriever/stage.py)."""

    def run(self, s: RunState) -> None:
        def teach(zeroshot: Any, examples: list) -> tuple[dict, dict]:  # the reranker sits above the retriever
            return prepare_teacher(s.cfg, s.retrieval, zeroshot, examples, s.logger.sink())

        run_retriever_stage(s, teach, s.callbacks, s.report_intermediate)


class IndexStage:
    """The index of the run's encoder, evaluated and saved (`index_phase`)."""

    def run(self, s: RunState) -> None:
        index_phase(s)


class JointStage:
    """Both models trained together on this run's index (or the saved one: stages [joint])."""

    def run(self, s: RunState) -> None:
        # lazy: ragtrain.joint.stage imports ray; this module imports without it
        from ragtrain.joint.stage import run_joint_stage

        s.results.update(run_joint_stage(s.cfg, s.data, s.retrieval, s.built, s.out, s.logger))


class GeneratorStage:
    """The generator, retrieving with this run's index, or the saved one (stages: [generator])."""

    def run(self, s: RunState) -> None:
        # lazy: ragtrain.generator.stage imports ray; this module imports without it
        from ragtrain.generator.stage import run_generator_stage

        built = s.built
        s.results.update(run_generator_stage(s.cfg, s.data, s.retrieval if built else None, built, s.out, s.logger))


# Every stage a config may name, in the order they run (config.STAGES, whose checks refuse another order)
STAGES: dict[str, Stage] = {
    "retriever": RetrieverStage(),
    "index": IndexStage(),
    "joint": JointStage(),
    "generator": GeneratorStage(),
}


def run_stages(s: RunState) -> None:
    """The configured stages, in the table's order."""
    for name, stage in STAGES.items():
        if name in s.cfg.stages:
            stage.run(s)


def run(
    cfg: Config,
    *,
    train_callbacks: list | None = None,
    report_intermediate: bool = False,
    parent_run_id: str | None = None,
) -> dict[str, dict[str, float]]:
    """Run the configured stages end to end; returns {phase: metrics}.

    A Tune trial passes `train_callbacks` (TuneReportCallback), `report_intermediate=True` (ray.train.report at
    every log window, so schedulers see learning curves) and its sweep's `parent_run_id` (MLflow child run).
    """
    done = finished_results(cfg)
    if done is not None:
        return done
    initial = functools.cache(lambda: initial_weights(cfg))  # built once: by the corpus stream, or below
    data, out, run_log, lock = start_run(cfg, initial)
    try:
        logger = open_logger(cfg, out, run_log, parent_run_id)
    except BaseException as e:  # the folder is marked failed (not left "running") and let go
        write_status(out, "failed", error=f"{type(e).__name__}: {e}"[:2000])
        lock.release()
        raise
    status, cleanup = "FAILED", [lambda: detach_run_log(run_log), lock.release]
    try:
        log_config(cfg, out, logger)
        s = RunState(cfg, data, out, logger, Retrieval(cfg, data), initial(), f"{cfg.retriever.model}@init",
                     callbacks=train_callbacks, report_intermediate=report_intermediate)  # fmt: skip
        cleanup.append(s.retrieval.close)
        run_stages(s)
        report_phase(s)
        status = "FINISHED"
        write_status(out, "complete")
        return s.results
    except BaseException as e:  # Ctrl+C included: the folder says the run did not finish, and why
        write_status(out, "failed", error=f"{type(e).__name__}: {e}"[:2000])
        raise
    finally:
        try:  # a clean-up that fails (Ray gone, say) must not leave the MLflow run RUNNING
            for fn in cleanup:
                fn()
            if cfg.profile:  # a failed run's timeline is the one most worth reading
                write_timeline(out, logger)
        finally:
            logger.end(status)


def start_run(
    cfg: Config, initial: Callable[[], dict[str, torch.Tensor]]
) -> tuple[RetrievalData, Path, Any, run_lock.RunLock]:
    """Every check that needs no training runs first; config.yaml is written only once they have all passed, so a
    folder that failed them is never taken for a run by resume=true, and what the checks wrote is removed.
    Returns (data, the run's folder, its log handler, this process's lock on the folder)."""
    run_lock.check_owner(cfg.output_dir)  # a live run's folder: refused before anything, whatever the settings
    check_fresh_output(cfg)
    lock = None
    try:
        with undo_on_failure(cfg.output_dir, cfg.index.cache_dir):
            out = prepare_output_dir(cfg.output_dir)  # an unwritable folder fails before any work
            lock = run_lock.acquire(out)  # the folder is this process's until the run ends
            if cfg.index.cache_dir:  # the cache is written after the first encode: refuse an unwritable one now
                prepare_output_dir(cfg.index.cache_dir, "index.cache_dir")
            with collect_log_lines() as check_lines:  # the [data] lines: into ragtrain.log once the checks pass
                data = preflight_checks(cfg, out, initial)
    except BaseException:
        if lock is not None:
            lock.release()
        raise
    (out / "config.yaml").write_text(OmegaConf.to_yaml(OmegaConf.structured(cfg)))  # the resolved, typed config
    write_status(out, "running")
    run_log = attach_run_log(out)  # ragtrain's lines of this run, timestamped, in <output_dir>/ragtrain.log
    replay(check_lines, run_log)
    return data, out, run_log, lock


def open_logger(cfg: Config, out: Path, run_log: Any, parent_run_id: str | None) -> Any:
    """The run's MLflow run. resume=true: a new run takes over the one recorded in <output_dir>/mlflow_run_id with
    its history up to the checkpoints it resumes from, and the file names the new run (a second resume chains)."""
    run_file = out / "mlflow_run_id"
    resume_id = run_file.read_text().strip() if cfg.resume and run_file.exists() else None
    try:
        logger = RunLogger(
            cfg.logger,
            run_name=cfg.experiment_name,
            parent_run_id=parent_run_id,
            resume_of=resume_id or None,
            keep_through=checkpointed_steps(cfg) if resume_id else None,
        )
    except Exception as e:  # a store the checks could not judge (e.g. a schema of another MLflow version): one line
        detach_run_log(run_log)
        uri = redact_uri(tracking_uri(cfg.logger))
        raise ConfigError(
            f"logger.tracking_uri={uri!r}: MLflow cannot open the store ({str(e).splitlines()[0][:300]})"
        ) from e
    except BaseException:
        detach_run_log(run_log)
        raise
    if logger.enabled:
        run_file.write_text(logger.run_id or "")
    if logger.enabled and os.environ.get("RAY_ADDRESS") and store_folder(logger.uri) is not None:
        # every node sees it (checked above), but SQLite's locks over a network filesystem are not to be trusted
        log.warning(
            f"RAY_ADDRESS is set and MLflow logs to a file store ({logger.uri}) that rank 0 writes from "
            "another node: prefer an MLflow server (logger.tracking_uri or MLFLOW_TRACKING_URI)"
        )
    return logger


def checkpointed_steps(cfg: Config) -> Callable[[str], int | None]:
    """For a resumed run: the last step of each metric that its checkpoints account for (None: every step). A
    stage's metrics (the generator's `gen_*`, the joint stage's `joint/*`, the retriever's and the phases around it
    the rest) past its latest checkpoint were logged by the stopped run after that point, and are logged again by the
    resumed one; a stage that finished, or that this run does not train, keeps all of its metrics."""
    # lazy: ragtrain.train.harness is the training layer's; this module imports it only when it resumes
    from ragtrain.train.harness import resume_or_none

    def last_step(stage: str) -> int | None:
        if stage not in cfg.stages:
            return None
        _, meta = resume_or_none(cfg, stage)
        if meta.get("final"):
            return None
        return int(meta.get("step", 0))  # no checkpoint: the stage trains from its first step again

    retriever, generator, joint = last_step("retriever"), last_step("generator"), last_step("joint")
    # the joint stage's own keys, and its live refresh's index/* where no retriever stage logs them
    joint_keys = ("joint/", "index/") if "retriever" not in cfg.stages else ("joint/",)
    return lambda key: generator if key.startswith("gen_") else joint if key.startswith(joint_keys) else retriever


def log_config(cfg: Config, out: Path, logger: Any) -> None:
    """The run's parameters (with what `auto` means here) and config.yaml; a resumed run keeps its params."""
    if not logger.resumed:
        logger.log_params({**to_flat_dict(cfg), **resolved_params(cfg)})
    logger.log_artifact(out / "config.yaml")


def index_phase(s: RunState) -> None:
    """The index of the run's encoder, evaluated and saved; under sync=vector_avg the consensus of every replica's
    vectors beside the parameter mean (and, with index.distill_steps, one student for it); with
    index.align_anchors the stale zero-shot index aligned to it."""
    cfg, retrieval, results, reps = s.cfg, s.retrieval, s.results, s.replicas
    phase = "trained" if "retriever" in cfg.stages else "zeroshot"
    if reps:  # vector_avg: first the parameter mean, for comparison; then the mean of the vectors
        param_avg, results["param_avg"] = retrieval.build_and_evaluate("param_avg", [s.weights], s.encoder_name, s.step)
    name = f"vector_avg of {len(reps)} replicas in {s.out / 'encoder'}" if reps else s.encoder_name
    s.built, results[phase] = retrieval.build_and_evaluate(phase, reps or [s.weights], name, s.step)
    if reps:  # mean 1 - cos on a seeded sample of passages, read from both builds' shards
        ids = sample_ids(s.built.corpus_ids, DRIFT_SAMPLE, cfg.seed + 1)
        results["param_avg"]["drift_vs_consensus"] = drift(param_avg.shards, s.built.shards, ids)
    if reps and cfg.index.distill_steps:  # one student encoder that serves the consensus index
        _, results["distilled"] = distill_consensus(retrieval, s.built, s.weights, s.step)
    if s.stale is not None and not reps:  # align the stale index instead of re-encoding it: how close?
        results.update(retrieval.evaluate_stale(s.stale, s.built, s.step))
    if not isinstance(s.built.index, Index):  # the run's own index shards write themselves
        raise TypeError(f"the run's index must be one that saves itself, got {s.built.index!r}")
    save_atomic(s.built.index, s.out / "index")  # a temporary folder, renamed when complete
    s.logger.log_json(asdict(s.built.index.meta), "index_meta.json")


def report_phase(s: RunState) -> None:
    """metrics.json, every phase's summary into MLflow, the export folder, and the console's summary."""
    cfg, out, results, logger = s.cfg, s.out, s.results, s.logger
    (out / "metrics.json").write_text(json.dumps(results, indent=2, sort_keys=True))
    logger.log_artifact(out / "metrics.json")
    for phase, m in results.items():  # zero-shot at step 0, the trained encoder at its last step
        if phase.startswith(("gen_", "joint")):
            continue  # the generator and joint stages logged their own, at their own steps
        prefix = "run/" if phase == "train" else f"{phase}/"  # run summary: run/train/samples_per_s, ...
        sink = logger.sink()
        if sink is not None:
            sink.skip_logged = cfg.resume  # a resumed run already holds the phases finished before
            sink.log({prefix + k: v for k, v in m.items()}, step=0 if phase == "zeroshot" else s.step)
    if cfg.export:  # every stage leaves a model to export
        encoded = bool({"retriever", "index"} & set(cfg.stages))  # this run trained or indexed with `weights`
        d = s.data
        about = f"{d.name}: {len(d.corpus)} passages, {len(d.train_qrels)} training queries, evaluated on "
        about += f"{len(d.eval_qrels)} {d.split} queries"
        # <output_dir>/export: sentence-transformers + HF folders
        answers = answer_block(cfg, results)
        export_run(cfg, s.weights if encoded else None, out, about, summary_table(results), logger, answers)
    log.info(f"\n== {cfg.experiment_name}: {s.data.name} split={s.data.split} index={cfg.index.factory} ==")
    log.info(summary_table(results))
    if "train" in results:
        t = results["train"]
        log.info(
            f"training: {t['steps']:.0f} steps, {t['train/samples_per_s']:.1f} samples/s, "
            f"{t['comm/bytes_per_step'] / 1e6:.2f} MB sent/step/worker, comm time share {t['comm/time_share']:.2f}"
        )
    log.info(f"outputs: {out.resolve()}" + (f"\nmlflow: {logger.uri} run {logger.run_id}" if logger.enabled else ""))
