"""docs/reference/rest-api.md is generated from the app's OpenAPI (``python -m ampkit.cli.docs``),
as cli.md is from the parsers: a route or field changed without regenerating fails here."""

from __future__ import annotations

import copy
import pathlib

import pytest

pytest.importorskip("fastapi")

from ampkit.cli.docs import main as docs_main  # noqa: E402
from ampkit.service.app import create_app  # noqa: E402
from ampkit.service.reference import rest_reference  # noqa: E402
from ampkit.service.schemas import ServiceConfig  # noqa: E402

ROOT = pathlib.Path(__file__).resolve().parents[2]
COMMITTED = ROOT / "docs" / "reference" / "rest-api.md"


@pytest.fixture(scope="module")
def openapi(tmp_path_factory):
    return create_app(
        ServiceConfig(data_dir=str(tmp_path_factory.mktemp("ref"))), tokens={}
    ).openapi()


def test_the_committed_reference_is_the_generated_one(openapi):
    text = COMMITTED.read_text(encoding="utf-8")
    assert text == rest_reference(openapi), (
        "docs/reference/rest-api.md is out of date: run `python -m ampkit.cli.docs`"
    )
    assert text == rest_reference()  # the default: the app's own description


def test_every_route_parameter_and_body_field_is_in_it(openapi):
    text = rest_reference(openapi)
    schemas = openapi["components"]["schemas"]
    for path, ops in openapi["paths"].items():
        for method, op in ops.items():
            assert f"### `{method.upper()} {path}`" in text
            for p in op.get("parameters", []):
                assert p["in"] == "path" or f"| `{p['name']}` |" in text
            body = (
                op.get("requestBody", {})
                .get("content", {})
                .get("application/json", {})
                .get("schema")
            )
            if body:
                name = body["$ref"].rsplit("/", 1)[-1]
                for field in schemas[name]["properties"]:
                    assert f"| `{field}` |" in text, (name, field)
    run = schemas["RunSpec"]["properties"]
    assert "| `steps` | integer | `100` | ≥ 1, ≤ 1,000,000 | optimizer steps |" in text
    assert all(p.get("description") for p in run.values()), "every RunSpec field says what it means"


def test_a_changed_route_or_field_makes_it_stale(openapi, tmp_path):
    before = rest_reference(openapi)
    added = copy.deepcopy(openapi)
    added["components"]["schemas"]["RunSpec"]["properties"]["warmup_steps"] = {
        "type": "integer",
        "default": 0,
    }
    assert rest_reference(
        added
    ) != before and "| `warmup_steps` | integer | `0` |" in rest_reference(added)
    bounds = copy.deepcopy(openapi)
    bounds["components"]["schemas"]["RunSpec"]["properties"]["steps"]["maximum"] = 10.0
    assert rest_reference(bounds) != before
    removed = copy.deepcopy(openapi)
    del removed["paths"]["/v1/compare"]
    assert "/v1/compare`" not in rest_reference(removed)
    (tmp_path / "rest-api.md").write_text(rest_reference(added), encoding="utf-8")
    assert docs_main(["--check", "--out", str(tmp_path)]) == 1  # the check compares with the app's
