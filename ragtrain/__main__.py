"""`python -m ragtrain experiment=NAME [key=value ...]`: compose, validate and resolve on the driver, then run."""

from __future__ import annotations

import os
import sys
from pathlib import Path

if not os.environ.get("RAY_ADDRESS"):
    # The embedded default starts its own Ray on 127.0.0.1: Ray reads this flag when it is first imported and
    # otherwise binds the machine's interface address (firewall prompts, unreachable on locked-down hosts).
    # A cluster (RAY_ADDRESS set) keeps its own networking.
    os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")

import hydra  # noqa: E402
from omegaconf import DictConfig  # noqa: E402

from ragtrain.config import ConfigError, override_variants, register_configs, sync_variants, to_typed  # noqa: E402

CONF_DIR = str(Path(__file__).resolve().parents[1] / "conf")
register_configs()


@hydra.main(version_base="1.3", config_path=CONF_DIR, config_name="config")
def main(cfg: DictConfig) -> None:
    """Hydra entry point."""
    try:
        typed = to_typed(cfg)  # resolves interpolations and runs every range check before any work
        if typed.tune is not None:  # tune=NAME: a sweep; its space is checked here too, before Ray starts
            from ragtrain.tune.sweep import plan_sweep

            plan_sweep(typed, CONF_DIR)
        variants = sync_variants(cfg, CONF_DIR) if typed.compare.strategies else {}
        if typed.compare.variants:  # named override sets, e.g. experiment=scifact_refresh
            variants.update(override_variants(cfg))
    except ConfigError as e:
        print(f"config error: {e}", file=sys.stderr)
        raise SystemExit(2) from None
    if typed.tune is not None:
        from ragtrain.cluster.resources import InfeasibleResourcesError
        from ragtrain.tune.sweep import run_sweep

        try:
            result = run_sweep(typed, CONF_DIR)
        except (ConfigError, InfeasibleResourcesError) as e:  # resume mismatches, a trial bigger than the cluster
            print(f"sweep error: {e}", file=sys.stderr)
            raise SystemExit(2) from None
        if result.interrupted:  # Ctrl+C: state saved, continue with resume=true
            raise SystemExit(130)
        return
    if variants:
        from ragtrain.sync_compare import run_sync_compare

        run_sync_compare(variants, typed.output_dir)
        return
    from ragtrain.data.types import DataError
    from ragtrain.pipeline import run

    try:
        run(typed)
    except (ConfigError, DataError) as e:  # bad input found while loading data: one line, before any encoding
        print(f"{'config' if isinstance(e, ConfigError) else 'data'} error: {e}", file=sys.stderr)
        raise SystemExit(2) from None


if __name__ == "__main__":
    main()
