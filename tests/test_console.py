"""The quiet console: which library lines are dropped, and that only those are."""

from __future__ import annotations

import logging


def test_only_rays_token_auth_enabled_note_is_dropped(caplog) -> None:
    from ragtrain.console import AUTH_LOGGER, quiet_loggers

    quiet_loggers()
    quiet_loggers()  # idempotent: one filter however often the workers' setup hook runs
    auth = logging.getLogger(AUTH_LOGGER)
    assert len(auth.filters) == 1
    with caplog.at_level(logging.WARNING, logger=AUTH_LOGGER):
        auth.warning("Token authentication is enabled for this Ray cluster. Set RAY_AUTH_MODE=disabled to opt out.")
        auth.warning("Token authentication is disabled for this Ray cluster. Anyone with network access ...")
    messages = [r.getMessage() for r in caplog.records]
    assert messages == ["Token authentication is disabled for this Ray cluster. Anyone with network access ..."]
