"""The live refresh's variant names checked against their registries, before any work (no Ray, no FAISS here)."""

from __future__ import annotations

from ragtrain.config import FaultConfig
from ragtrain.config.index import RefreshConfig
from ragtrain.index.consistency import POLICIES
from ragtrain.index.priority import PRIORITIES
from ragtrain.runtime.errors import ConfigError, check


def check_refresh(
    refresh: RefreshConfig, dim: int | None = None, rows: int | None = None, fault: FaultConfig | None = None
) -> None:
    """refresh.consistency and refresh.priority name registered variants (a ConfigError lists the valid names);
    `fault`'s live-refresh hooks act on what the policy has (a barrier); given the encoder's `dim` and the corpus's
    `rows`, the enabled policy's own check of its settings too."""
    for key, value, registry in (
        ("refresh.consistency", refresh.consistency, POLICIES),
        ("refresh.priority", refresh.priority, PRIORITIES),
    ):
        if value not in registry:
            raise ConfigError(f"{key}={value!r} is not a known choice; valid choices: {list(registry)}")
    policy = POLICIES[refresh.consistency]
    if fault is not None:  # a fault hook the policy has no place for would never fire
        barriers = "/".join(name for name, p in POLICIES.items() if p.has_barrier)
        check(
            fault.kill_shard_before_apply < 0 or policy.has_barrier,
            "fault.kill_shard_before_apply",
            f"kills a shard between the barrier and the apply of refresh.consistency={barriers}, and "
            f"refresh.consistency={refresh.consistency} has no barrier",
            fault.kill_shard_before_apply,
        )
    if refresh.enabled and dim is not None and rows is not None:
        policy().check(refresh, dim, rows)


def refresh_warnings(refresh: RefreshConfig) -> list[str]:
    """Live-refresh settings that are legal but read by nothing here (one warning line each)."""
    policy = POLICIES.get(refresh.consistency)
    if refresh.enabled and refresh.anchors != RefreshConfig.anchors and policy and not policy.needs_anchors:
        needing = [name for name, p in POLICIES.items() if p.needs_anchors]
        return [f"refresh.anchors={refresh.anchors} is read only by refresh.consistency={'/'.join(needing)} "
                f"({refresh.consistency} here)"]  # fmt: skip
    return []
