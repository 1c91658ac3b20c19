"""A tracking server behind HTTP basic auth: credentials in logger.tracking_uri work, and appear in no file,
parameter, artifact or console line of the run."""

from __future__ import annotations

import base64
import http.client
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import urlsplit

import pytest

from tests.conftest import compose, tiny_overrides

USER, SECRET = "alice", "s3cr3t-Pw-7781"


class _BasicAuthProxy(ThreadingHTTPServer):
    """An HTTP server on 127.0.0.1 that answers 401 without the right basic auth and forwards every other request to
    the MLflow server (as a reverse proxy with authentication in front of MLflow does)."""

    daemon_threads = True

    def __init__(self, upstream: str):
        self.upstream = urlsplit(upstream)
        self.expected = "Basic " + base64.b64encode(f"{USER}:{SECRET}".encode()).decode()
        self.refused = 0
        super().__init__(("127.0.0.1", 0), _Forward)


class _Forward(BaseHTTPRequestHandler):
    def log_message(self, *_) -> None:
        pass

    def _forward(self) -> None:
        server: _BasicAuthProxy = self.server  # type: ignore[assignment]
        if self.headers.get("Authorization") != server.expected:
            server.refused += 1
            self.send_response(401)
            self.send_header("WWW-Authenticate", 'Basic realm="mlflow"')
            self.send_header("Content-Length", "0")
            self.end_headers()
            return
        body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
        headers = {k: v for k, v in self.headers.items() if k.lower() not in ("host", "authorization", "connection")}
        conn = http.client.HTTPConnection(server.upstream.hostname, server.upstream.port, timeout=60)
        conn.request(self.command, self.path, body=body or None, headers=headers)
        r = conn.getresponse()
        data = r.read()
        self.send_response(r.status)
        for k, v in r.getheaders():
            if k.lower() not in ("transfer-encoding", "connection", "content-length"):
                self.send_header(k, v)
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)
        conn.close()

    do_GET = do_POST = do_PUT = do_PATCH = do_DELETE = _forward


@pytest.fixture
def auth_proxy(mlflow_server, monkeypatch):
    for k in ("MLFLOW_TRACKING_USERNAME", "MLFLOW_TRACKING_PASSWORD"):
        monkeypatch.setenv(k, "")  # recorded, so that what the run sets from the URI is undone after the test
        monkeypatch.delenv(k)
    proxy = _BasicAuthProxy(mlflow_server)
    threading.Thread(target=proxy.serve_forever, daemon=True).start()
    yield proxy, f"http://{USER}:{SECRET}@127.0.0.1:{proxy.server_address[1]}"
    proxy.shutdown()


def test_a_wrong_password_is_one_line_before_any_work(auth_proxy, tmp_path) -> None:
    from ragtrain.config import to_typed
    from ragtrain.runtime.errors import ConfigError
    from ragtrain.track.mlflow import check_tracking_uri, tracking_uri

    proxy, uri = auth_proxy
    cfg = to_typed(
        compose(
            ["experiment=quickstart", f"output_dir={tmp_path}", "logger.tracking_uri=" + uri.replace(SECRET, "wrong")]
        )
    )
    with pytest.raises(
        ConfigError,
        match=r"logger.tracking_uri .*='http://127.0.0.1:\d+' refused the credentials "
        r"\(HTTP 401\)",
    ) as e:
        check_tracking_uri(tracking_uri(cfg.logger))
    assert "wrong" not in str(e.value) and proxy.refused == 1


def test_credentials_in_the_uri_work_and_appear_nowhere(ray_session, auth_proxy, tmp_path, capfd, caplog) -> None:
    """A run that logs params, its config, metrics and the exported model (with its card) through the proxy; then
    every file of its folder, every parameter and artifact in MLflow and the console are searched for the secret."""
    import logging

    from mlflow.tracking import MlflowClient

    from ragtrain.config import to_typed
    from ragtrain.pipeline.stages import run

    proxy, uri = auth_proxy
    over = [o for o in tiny_overrides(tmp_path) if not o.startswith("logger.tracking_uri")]
    cfg = to_typed(
        compose(
            [
                "experiment=quickstart",
                *over,
                "stages=[index]",
                # one encode actor: an actor is a process that imports torch and builds the encoder, and what is
                # searched for here does not depend on how many encode (the pool of 2 is tested in tests/corpus)
                "resources.pool.num_actors=1",
                f"logger.tracking_uri={uri}",
                "logger.experiment_name=credentials",
            ]
        )
    )
    assert cfg.logger.tracking_uri == f"http://127.0.0.1:{proxy.server_address[1]}"  # the config holds no secret
    with caplog.at_level(logging.INFO):
        results = run(cfg)
    assert results["zeroshot"]["ndcg@10"] > 0 and proxy.refused == 0
    leaks = [str(p) for p in Path(cfg.output_dir).rglob("*") if p.is_file() and SECRET.encode() in p.read_bytes()]
    client = MlflowClient(proxy.upstream.geturl())  # straight to the server: this reader needs no auth
    runs = client.search_runs([client.get_experiment_by_name("credentials").experiment_id])
    assert len(runs) == 1
    r = runs[0]
    leaks += [f"param {k}" for k, v in r.data.params.items() if SECRET in v]
    leaks += [f"tag {k}" for k, v in r.data.tags.items() if SECRET in v]
    local = Path(client.download_artifacts(r.info.run_id, "", str(tmp_path / "artifacts")))
    files = [p for p in local.rglob("*") if p.is_file()]
    assert any(p.name == "config.yaml" for p in files)
    leaks += [f"artifact {p.relative_to(local)}" for p in files if SECRET.encode() in p.read_bytes()]
    out, err = capfd.readouterr()
    leaks += [f"console: {line}" for line in (out + err + caplog.text).splitlines() if SECRET in line]
    assert not leaks, leaks
