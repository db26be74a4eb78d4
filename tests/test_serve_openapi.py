"""`/openapi.json` is the contract: schemathesis `--checks all` against a live server (bounded), every schema-valid
POST body a song or one of the 422s no schema can express, and docs/serving.md's API table checked against it."""
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from yue2_vllm.serve.errors import RequestInvalid
from yue2_vllm.serve.service import ServeConfig, SongService
from yue2_vllm.serve.submission import parse_submission

from serving import ThreadServer, pipe  # noqa: F401 (pipe: a fixture)

ROOT = Path(__file__).resolve().parent.parent
KEY = "openapi-test-key-0123456789"
# What a schema-valid body may still be refused for (tests/schemathesis.toml says why): the context budget,
# min_tokens over a merged max_tokens, an instrumental's score that the edit cannot read (named by its line).
CROSS_FIELD = re.compile(r"the request is too long|min_tokens must be in \[0, max_tokens\]|"
                         r"^abc: (score line \d+|score): |^seconds: .* below the semantic phase's min_tokens|"
                         r"^transcription is \d+ bytes of JSON, more than 16384|'transcription' records where the score")
schemathesis = pytest.importorskip("schemathesis", reason="pip install 'yue2-vllm[test]'")


@pytest.fixture(scope="module")
def server(pipe, tmp_path_factory):
    # A short queue: the fuzzer's songs are a few, then 429s (documented), so the run stays bounded.
    # Speech calls give up waiting after 5 s (504, documented), so the fuzzer's queued songs cannot stretch the run.
    service = SongService(pipe, ServeConfig(tmp_path_factory.mktemp("openapi") / "data", queue_size=4,
                                            concurrency=1, speech_wait_seconds=5))
    server = ThreadServer(service, api_key=KEY)
    yield server
    server.stop()


@pytest.fixture(scope="module")
def openapi(server):
    response = server.client.get("/openapi.json")
    assert response.status_code == 200
    return response.json()


# Every operation, every check, in 30 s by default; the slow run fuzzes 120 s.
@pytest.mark.parametrize("max_time", [30, pytest.param(120, marks=pytest.mark.slow)])
def test_schemathesis_all_checks_pass(server, tmp_path, max_time):
    command = [str(Path(sys.executable).with_name("st")), "--no-color", "--config-file",
               str(ROOT / "tests" / "schemathesis.toml"), "run", f"{server.url}/openapi.json", "--checks", "all",
               "--max-time", str(max_time), "--seed", "20", "-H", f"Authorization: Bearer {KEY}",
               "--report-junit-path", str(tmp_path / "junit.xml")]
    run = subprocess.run(command, capture_output=True, text=True, timeout=max_time + 240, cwd=tmp_path)
    output = run.stdout + run.stderr
    assert run.returncode == 0, output[-12000:]
    assert re.search(r"Tested: 34\b", output), output[-3000:]
    assert "enabled = false" not in (ROOT / "tests" / "schemathesis.toml").read_text(encoding="utf-8")  # no check off


def test_each_schemathesis_block_configures_only_its_own_operation(openapi):
    """schemathesis ORs a block's include-* keys (include-path and include-method matched every POST), so each block
    names its one operation with include-name; every operation gets its own block's statuses or none."""
    from schemathesis.config import SchemathesisConfig

    config = SchemathesisConfig.from_path(str(ROOT / "tests" / "schemathesis.toml"))
    schema = schemathesis.openapi.from_dict(openapi, config=config)
    operations = [schema[path][method.upper()] for path, methods in openapi["paths"].items() for method in methods]
    blocks = schema.config.operations.operations
    matched = [[operation.label for operation in operations if block._filter_set.applies_to(operation=operation)]
               for block in blocks]
    assert len(blocks) == 7 and all(len(labels) == 1 for labels in matched), matched


def test_the_song_body_and_every_status_are_documented(openapi):
    post = openapi["paths"]["/v1/songs"]["post"]
    assert post["requestBody"]["content"]["application/json"]["schema"] == {"$ref": "#/components/schemas/SongBody"}
    body = openapi["components"]["schemas"]["SongBody"]
    assert "required" not in body and body["additionalProperties"] is False  # lyrics: unless instrumental
    assert {"if": {"not": {"required": ["instrumental"], "properties": {"instrumental": {"const": True}}}},
            "then": {"required": ["lyrics"]}} in body["allOf"]
    assert body["properties"]["instrumental"]["type"] == "boolean"
    assert set(body["properties"]) >= {"style", "tags", "lyrics", "cot", "seed", "abc", "cfg_scale", "id",
                                       "abc_sampling", "semantic_sampling", "stage", "reproducible", "instrumental"}
    assert body["properties"]["reproducible"]["const"] is False  # this server is not --reproducible
    assert set(post["responses"]) == {"200", "202", "400", "401", "403", "409", "413", "415", "422", "429", "503",
                                      "507"}
    assert "Idempotency-Key was used with another body" in post["responses"]["422"]["description"]
    song = openapi["paths"]["/v1/songs/{job_id}"]
    assert set(song["delete"]["responses"]) == {"202", "204", "400", "401", "403", "404", "422"}
    assert set(openapi["paths"]["/v1/songs/{job_id}/cancel"]["post"]["responses"]) == {"200", "202", "400", "401",
                                                                                       "403", "404", "422"}
    error = {"$ref": "#/components/schemas/ErrorBody"}
    for path, operations in openapi["paths"].items():
        for method, operation in operations.items():
            for status, response in operation["responses"].items():
                if int(status) >= 400 and status != "416" and path != "/health":
                    assert response["content"]["application/json"]["schema"] == error, (method, path, status)
    assert openapi["components"]["schemas"]["ErrorDetail"]["required"] == ["status", "message", "field"]
    assert openapi["components"]["securitySchemes"]["HTTPBearer"]["scheme"] == "bearer"


def test_every_schema_valid_body_is_a_song_or_a_cross_field_422(pipe, openapi):
    from hypothesis import HealthCheck, given, settings

    operation = schemathesis.openapi.from_dict(openapi)["/v1/songs"]["POST"]

    @settings(max_examples=300, deadline=None, suppress_health_check=list(HealthCheck))
    @given(operation.as_strategy())
    def check(case):
        try:
            parse_submission(pipe, json.dumps(case.body).encode(), "j" + "0" * 20)
        except RequestInvalid as exc:
            assert CROSS_FIELD.search(exc.message), (case.body, exc.message)

    check()


# --------------------------------------------------------------------------- docs/serving.md's API table


def documented_operations() -> dict[tuple[str, str], set[int]]:
    """`{(METHOD, path): bold statuses}` from docs/serving.md's API table (`GET /v1/songs/{id}/audio`, `/score` names
    `GET /v1/songs/{id}/score` too)."""
    text = (ROOT / "docs" / "serving.md").read_text(encoding="utf-8")
    table = text.split("| endpoint | answers |", 1)[1].split("\n\n", 1)[0]
    operations = {}
    for row in table.strip().splitlines()[1:]:
        cell, answers = row.strip("|").split("|", 1)
        statuses = {int(s) for s in re.findall(r"\*\*(\d{3})\*\*", answers)}
        methods, base = None, None
        for item in re.findall(r"`([^`]+)`", cell):
            words = item.split()
            if len(words) == 2:
                methods, base = words[0].split("/"), words[1].split("?")[0]
                path = base
            else:
                path = base.rsplit("/", 1)[0] + words[0]
            for method in methods:
                operations[(method, path)] = statuses
    return operations


def test_the_serving_docs_api_table_is_the_openapi_contract(openapi):
    documented = {}
    for path, operations in openapi["paths"].items():
        for method, operation in operations.items():
            documented[(method.upper(), path.replace("{job_id}", "{id}"))] = {int(s) for s in operation["responses"]}
    table = documented_operations()
    assert set(table) == set(documented), (sorted(set(table) ^ set(documented)))
    for operation, statuses in table.items():
        assert statuses <= documented[operation], (operation, statuses - documented[operation])


def test_non_blank_means_what_the_cli_check_means_in_every_regex_engine():
    """A text field's pattern accepts exactly what `str.strip()` leaves non-empty: JSON Schema's `\\S` (ECMA),
    pydantic's (Rust) and Python's disagree on U+001C–U+001F, U+0085 and U+FEFF, so the pattern spells its class
    out (hypothesis once sent `abc: "\\x1f"`, valid by `\\S` in the schema and blank to the CLI's check)."""
    from pydantic import ValidationError

    from yue2_vllm.serve.contract import NON_BLANK, SongBody

    assert "\\s" not in NON_BLANK and "\\S" not in NON_BLANK
    for code in [*range(0x3001), 0xFEFF, 0x10FFFF]:
        if 0xD800 <= code < 0xE000:
            continue
        char = chr(code)
        assert (re.search(NON_BLANK, char) is not None) == bool(char.strip()), hex(code)
        try:
            SongBody(lyrics=char, style="pop")
            accepted = True
        except ValidationError:
            accepted = False
        assert accepted == bool(char.strip()), hex(code)
