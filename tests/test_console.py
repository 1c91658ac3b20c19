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


def test_a_worker_names_its_own_cluster_to_rays_state_api(ray_session) -> None:
    """With a second Ray on the machine, the State API's search for "the" cluster raised in Ray Train's
    placement-group cleaner (a traceback on the console); each worker now names its own."""
    import ray

    @ray.remote(num_cpus=0)
    def setup_and_look() -> tuple[str, str]:
        import os

        os.environ.pop("RAY_API_SERVER_ADDRESS", None)
        from ragtrain.console import worker_setup

        worker_setup()
        return os.environ.get("RAY_API_SERVER_ADDRESS", ""), ray.get_runtime_context().gcs_address

    named, own = ray.get(setup_and_look.remote())
    assert named == own and own


def test_the_driver_does_not_pin_the_state_api_to_its_cluster(ray_session, monkeypatch) -> None:
    import os

    from ragtrain.console import worker_setup

    monkeypatch.delenv("RAY_API_SERVER_ADDRESS", raising=False)
    worker_setup()  # the driver runs it too (an encoder in-process) and may start another Ray later
    assert "RAY_API_SERVER_ADDRESS" not in os.environ
