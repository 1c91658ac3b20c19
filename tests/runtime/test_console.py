"""The quiet console: which library lines are dropped, and that only those are."""

from __future__ import annotations

import logging


def test_only_rays_token_auth_enabled_note_is_dropped(caplog) -> None:
    from ragtrain.runtime.console import AUTH_LOGGER, quiet_loggers

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
        from ragtrain.runtime.console import worker_setup

        worker_setup()
        return os.environ.get("RAY_API_SERVER_ADDRESS", ""), ray.get_runtime_context().gcs_address

    named, own = ray.get(setup_and_look.remote())
    assert named == own and own


def test_the_driver_does_not_pin_the_state_api_to_its_cluster(ray_session, monkeypatch) -> None:
    import os

    from ragtrain.runtime.console import worker_setup

    monkeypatch.delenv("RAY_API_SERVER_ADDRESS", raising=False)
    worker_setup()  # the driver runs it too (an encoder in-process) and may start another Ray later
    assert "RAY_API_SERVER_ADDRESS" not in os.environ


def test_worker_lines_carry_no_colour_codes_outside_a_terminal(monkeypatch, capsys) -> None:
    """Ray prefixes every worker line with "(pid=...)" wrapped in colour codes; a run whose output goes to a file or
    a pipe (here: pytest's capture) prints them plain. Ray's own printer, as the driver runs it."""
    import io

    from ray._private.worker import print_worker_logs

    from ragtrain.runtime import console

    for key in ("RAY_COLOR_PREFIX", console.PROGRESS_ENV, *console.QUIET_ENV):  # restored after the test
        monkeypatch.delenv(key, raising=False)
    out = io.StringIO()
    print_worker_logs({"pid": 42, "ip": "127.0.0.1", "localhost": "127.0.0.1", "lines": ["[retriever] step 1"]}, out)
    assert "\x1b[" in out.getvalue()  # Ray's default: coloured
    console.configure(verbose=False)
    out = io.StringIO()
    print_worker_logs({"pid": 42, "ip": "127.0.0.1", "localhost": "127.0.0.1", "lines": ["[retriever] step 1"]}, out)
    assert out.getvalue() == "(pid=42) [retriever] step 1\n"
