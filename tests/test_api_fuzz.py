"""schemathesis against the OpenAPI schema FastAPI generates for serve-edge (tiny model, bounded examples):
no 5xx, and every 4xx in OpenAI's error shape."""

import pytest
import schemathesis
from hypothesis import HealthCheck, Phase, given, settings

from edgekv.serve.api_schema import APISettings
from edgekv.serve.openai_api import build_app
from edgekv.serve.pool import ExportPool
from edgekv.serve.session import EdgeSession
from tests.helpers import make_export

KEY = "sk-fuzz"


@pytest.fixture(scope="module")
def api_schema(edge, edge_dir, tmp_path_factory):  # noqa: F811 (the imported fixtures)
    tmp = tmp_path_factory.mktemp("fuzz")
    session = EdgeSession(edge, str(make_export(edge_dir, tmp / "kv", 1)), cache_dir=tmp / "c")
    pool = ExportPool.of_session("kv", session, max_batch=4, max_queue=64)
    app = build_app(pool, APISettings(api_key=KEY, max_body_bytes=8192, max_tokens_limit=16))
    yield schemathesis.openapi.from_asgi("/openapi.json", app)
    pool.close()


def _check(case) -> None:
    for headers in ({"Authorization": f"Bearer {KEY}"}, {}):
        response = case.call(headers=headers)
        assert response.status_code < 500, (case.method, case.path, case.body, response.text)
        if response.status_code >= 400:
            error = response.json()["error"]
            assert isinstance(error["message"], str) and error["message"], response.text
            assert {"type", "param", "code"} <= set(error), response.text
        if case.path.startswith("/v1/") and not headers:
            assert response.status_code in (401, 413), (case.path, response.status_code)  # size is checked first


def test_no_server_errors_and_errors_in_openais_shape(api_schema):
    # schemathesis' own pytest plugin does not load under this pytest; its strategies drive hypothesis directly
    operations = [op.ok() for op in api_schema.get_all_operations()]
    assert {f"{o.method.upper()} {o.path}" for o in operations} >= {
        "POST /v1/completions", "POST /v1/chat/completions", "GET /v1/models", "GET /health", "GET /metrics"}
    for operation in operations:
        @settings(max_examples=25, deadline=None, suppress_health_check=list(HealthCheck), derandomize=True,
                  database=None, phases=[Phase.explicit, Phase.generate])  # no shrinking: bounded time
        @given(case=operation.as_strategy())
        def run(case):
            _check(case)

        run()
