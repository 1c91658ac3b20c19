"""`python -m ragtrain experiment=NAME [key=value ...]`: compose, validate and resolve on the driver, then run.

`python -m ragtrain COMMAND ARGS...` (COMMAND one of `COMMANDS`) runs that command of ragtrain/commands/ instead:
`main(ARGS)` of its module, whose exit status is the process's.
"""

from __future__ import annotations

import importlib
import os
import re
import shutil
import sys
import traceback
from pathlib import Path

if not os.environ.get("RAY_ADDRESS"):
    # The embedded default starts its own Ray on 127.0.0.1: Ray reads this flag when it is first imported and
    # otherwise binds the machine's interface address (firewall prompts, unreachable on locked-down hosts).
    # A cluster (RAY_ADDRESS set) keeps its own networking.
    os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")

# The commands on finished runs and MLflow's runs (ragtrain/commands/<name>.py); conf/config.yaml's help header names
# them too. Any other first argument is an override of one run's config (Hydra's command line).
COMMANDS = ("search", "ask", "paired", "compare")


def run_command(argv: list[str]) -> int | None:
    """The exit status of `python -m ragtrain COMMAND ARGS...`, or None when argv names no command."""
    if not argv or argv[0] not in COMMANDS:
        return None
    return importlib.import_module(f"ragtrain.commands.{argv[0]}").main(argv[1:])


if __name__ == "__main__" and (_status := run_command(sys.argv[1:])) is not None:
    raise SystemExit(_status)  # before Hydra and the config schema load: a command imports what it needs only

import hydra  # noqa: E402
from hydra import compose, initialize_config_dir  # noqa: E402
from hydra.core.hydra_config import HydraConfig  # noqa: E402
from hydra.errors import HydraException  # noqa: E402
from hydra.types import RunMode  # noqa: E402
from omegaconf import DictConfig  # noqa: E402
from omegaconf.errors import OmegaConfBaseException  # noqa: E402

from ragtrain.cluster.resources import InfeasibleResourcesError  # noqa: E402
from ragtrain.config import check_ascii_numbers, has_non_ascii_digits, non_ascii_digits, register_configs, to_typed  # noqa: E402
from ragtrain.config.variants import override_variants, sync_variants  # noqa: E402
from ragtrain.runtime.console import configure, quiet_ray_data  # noqa: E402
from ragtrain.runtime.errors import ConfigError  # noqa: E402

CONF_DIR = str(Path(__file__).resolve().parents[1] / "conf")
register_configs()
# The run folder Hydra is about to make and those of its parents that exist already (set by check_overrides; None
# when it did not compose): a run that stops on a user error removes only what Hydra made for it.
_EXISTING_BEFORE: set[Path] | None = None


def user_errors() -> tuple[type[BaseException], ...]:
    """Exceptions that mean bad input (config, data, a cluster too small, a mismatched index) or a store that
    cannot serve (an index shard lost beyond its restarts): one line, exit 2."""
    # lazy: ragtrain.data loads its readers; the CLI starts without them
    from ragtrain.data.types import DataError

    kinds: list[type[BaseException]] = [ConfigError, DataError, InfeasibleResourcesError]
    # The index's errors only where the index modules are loaded: an error of theirs exists only then, and importing
    # them (faiss, torch, Ray) for a config refused at its checks cost most of that command's second of CPU
    for module, name in (
        ("ragtrain.index.faiss_index", "IndexMismatchError"),
        ("ragtrain.index.sharded", "ShardUnavailableError"),
    ):
        if module in sys.modules:
            kinds.append(getattr(sys.modules[module], name))
    return tuple(kinds)


ERROR_KINDS = {
    "ConfigError": "config",
    "DataError": "data",
    "InfeasibleResourcesError": "resources",
    "IndexMismatchError": "index",
    "ShardUnavailableError": "index",
}


def error_line(e: BaseException) -> str:
    """`<kind> error: <message>`: the message of the error itself, also when Ray re-raised it from an actor or a
    task (a RayTaskError whose text holds the remote traceback; its `cause` is the error that was raised)."""
    cause = getattr(e, "cause", None)
    if isinstance(cause, BaseException):  # ray.exceptions.RayTaskError
        e = cause
    kind = next((k for c in type(e).__mro__ if (k := ERROR_KINDS.get(c.__name__))), "input")
    return f"{kind} error: {e}"


def verbose(cfg: DictConfig) -> bool:
    """-v for ragtrain: HYDRA_FULL_ERROR=1 or hydra.verbose=true keep the traceback of a user error."""
    return os.environ.get("HYDRA_FULL_ERROR") == "1" or bool(HydraConfig.get().verbose)


def check_overrides(argv: list[str]) -> None:
    """Compose once before `@hydra.main` does: an override Hydra cannot merge (a value outside an enum's choices, a
    key the config lacks, an unknown group option) becomes one `config error:` line and exit 2, not Hydra's
    multi-line report and exit 1. Hydra's own flags (--help, --cfg, -m) and HYDRA_FULL_ERROR=1 are left to Hydra.
    It also notes which of the run folder's parents exist already (`remove_run_folder` keeps those)."""
    if any(a.startswith("-") for a in argv):
        return

    try:
        with initialize_config_dir(config_dir=CONF_DIR, version_base="1.3"):
            cfg = compose(config_name="config", overrides=argv, return_hydra_config=True)
    except (HydraException, OmegaConfBaseException) as e:
        if os.environ.get("HYDRA_FULL_ERROR") == "1":
            return  # Hydra reports it in full
        bare = [a for a in argv if has_non_ascii_digits(a.partition("=")[2])]  # Hydra's lexer takes only 0-9
        key, _, value = bare[0].lstrip("+~").partition("=") if bare else ("", "", "")
        line = (
            non_ascii_digits(key, value, " (quote it if it is text, not a number)") if bare else override_error_line(e)
        )
        print(f"config error: {line}", file=sys.stderr)
        raise SystemExit(2) from None
    global _EXISTING_BEFORE
    try:
        run_dir = Path(str(cfg.hydra.run.dir)).resolve()
    except OmegaConfBaseException:  # a run folder Hydra cannot name either: Hydra reports it; nothing to clean up
        return
    _EXISTING_BEFORE = {p for p in (run_dir, *run_dir.parents) if p.exists()}


def remove_run_folder(run_dir: Path) -> None:
    """After a user error: a run folder Hydra made for this run that holds only Hydra's own files (`.hydra/`, the
    job's log) is removed, with the empty parents made for it, so a mistyped value leaves nothing behind."""
    run_dir = run_dir.resolve()
    if _EXISTING_BEFORE is None or run_dir in _EXISTING_BEFORE or not run_dir.is_dir():
        return
    if not hydra_files_only(run_dir):
        return  # the run wrote something of its own: keep it all, with the log that explains it
    shutil.rmtree(run_dir)
    for parent in run_dir.parents:
        if parent in _EXISTING_BEFORE or any(parent.iterdir()):
            break
        parent.rmdir()


def hydra_files_only(folder: Path) -> bool:
    """The folder holds only what Hydra writes for a job (`.hydra/`, the job's log)."""
    return all(p.name == ".hydra" or p.suffix == ".log" for p in folder.iterdir())


def remove_sweep_folder(job_dir: Path, sweep_dir: Path) -> None:
    """After a user error in a `-m` run (Hydra stops the whole sweep there): the job's folder when it holds only
    Hydra's files, then the sweep's folder when only Hydra's multirun.yaml is left in it (jobs that ran keep
    theirs, and so the sweep's), and the empty parents Hydra made, up to the cwd."""
    job_dir, sweep_dir, cwd = job_dir.resolve(), sweep_dir.resolve(), Path.cwd().resolve()
    if cwd in (job_dir, sweep_dir) or cwd.is_relative_to(sweep_dir):  # e.g. hydra.sweep.dir=.: never the cwd
        return
    # Hydra made the job's folder when it holds its .hydra/ and at most the job's log (not a user's own logs)
    if job_dir.is_dir() and (job_dir / ".hydra").is_dir() and hydra_files_only(job_dir):
        shutil.rmtree(job_dir)
    if not sweep_dir.is_dir() or any(p.name != "multirun.yaml" for p in sweep_dir.iterdir()):
        return
    shutil.rmtree(sweep_dir)
    for parent in sweep_dir.parents:
        if parent == cwd or cwd not in parent.parents or any(parent.iterdir()):
            break
        parent.rmdir()


def override_error_line(e: BaseException) -> str:
    """Hydra's / OmegaConf's report of a bad override as one line: the headline and its causes (the reason, e.g.
    "expected one of [...]"), and a missing group option's available options; not the search path or full_key."""
    parts: list[str] = []
    while e is not None:
        text = str(e).split("Config search path:")[0]
        head, _, options = text.partition("Available options in ")
        parts += [ln.strip() for ln in head.splitlines() if ln.strip() and not ln[:1].isspace()]
        if options:  # "'sync':\n\tasync_ps\n\tddp ..." -> "valid choices: async_ps, ddp, ..."
            parts.append("valid choices: " + ", ".join(ln.strip() for ln in options.splitlines()[1:] if ln.strip()))
        e = e.__cause__  # type: ignore[assignment]
    return "; ".join(parts)


@hydra.main(version_base="1.3", config_path=CONF_DIR, config_name="config")
def main(cfg: DictConfig) -> None:
    """Hydra entry point: every user error is one line on stderr and exit code 2 (the traceback with -v)."""
    configure(verbose(cfg))  # library chatter off unless -v (hydra.verbose=true / HYDRA_FULL_ERROR=1)
    scrub_hydra_files()
    try:
        dispatch(cfg)
    except KeyboardInterrupt:  # Ctrl+C: the run folder says so (status.json), and how to go on
        print(
            f"interrupted: the run in {cfg.get('output_dir')} stopped; continue it with the same command and "
            "resume=true",
            file=sys.stderr,
        )
        raise SystemExit(130) from None
    except user_errors() as e:
        if verbose(cfg):  # the traceback too, then the same line, clean-up and exit code
            traceback.print_exc()
        print(error_line(e), file=sys.stderr)
        hc = HydraConfig.get()
        if hc.mode == RunMode.MULTIRUN:  # the job's folder, then the sweep's when only multirun.yaml is left
            remove_sweep_folder(Path(hc.runtime.output_dir), Path(hc.sweep.dir))
        else:
            remove_run_folder(Path(hc.runtime.output_dir))
        raise SystemExit(2) from None


_USERINFO = re.compile(r"(://)[^/\s@'\"]+@")


def scrub_hydra_files() -> None:
    """Hydra saved the command line (<run>/.hydra: overrides, config) before ragtrain read it: a URI's
    user:password@ part (logger.tracking_uri's basic auth) is replaced there, as nowhere else holds it."""
    hc = HydraConfig.get()
    if not hc.output_subdir:
        return
    for f in Path(hc.runtime.output_dir, hc.output_subdir).glob("*.yaml"):
        text = f.read_text()
        if _USERINFO.search(text):
            f.write_text(_USERINFO.sub(r"\1***@", text))


def dispatch(cfg: DictConfig) -> None:
    """Check everything that needs no work, then run one pipeline, a set of variants or a Tune sweep."""
    check_ascii_numbers(cfg, HydraConfig.get().overrides.task)  # `seed=١٢`: int() would read 12
    typed = to_typed(cfg)  # resolves interpolations and runs every range check before any work
    if typed.tune is not None:  # tune=NAME: a sweep; its space is checked here too, before Ray starts
        # lazy: ragtrain.tune.sweep imports pandas/pyarrow/ray; the CLI starts without them
        from ragtrain.tune.sweep import plan_sweep, run_sweep

        plan_sweep(typed, CONF_DIR)
        quiet_ray_data()  # checked: the work starts
        result = run_sweep(typed, CONF_DIR)
        if result.interrupted:  # Ctrl+C: state saved, continue with resume=true
            raise SystemExit(130)
        return
    variants = sync_variants(cfg, CONF_DIR) if typed.compare.strategies else {}
    if typed.compare.variants:  # named override sets, e.g. experiment=scifact_refresh
        variants.update(override_variants(cfg))
    # lazy: ragtrain.index imports numpy; the CLI starts without it
    from ragtrain.index.checks import check_refresh

    for each in [typed, *variants.values()]:  # every variant's live-refresh choices, before the first one runs
        check_refresh(each.refresh, fault=each.fault)
    quiet_ray_data()  # checked: the work starts
    if variants:
        # lazy: ragtrain.commands.variants imports pandas/pyarrow/torch; the CLI starts without them
        from ragtrain.commands.variants import run_variants

        run_variants(variants, typed.output_dir)
        return
    from ragtrain.pipeline.stages import run  # lazy: ragtrain.pipeline.stages imports torch; the CLI starts without it

    run(typed)


if __name__ == "__main__":
    check_overrides(sys.argv[1:])
    main()
