"""schemathesis over the gateway's OpenAPI document: every route, every built-in check.

The gateway runs in-process (ASGI) over the real router and device classes
behind fake handles, with authentication on; schemathesis generates valid and
invalid requests from the schema and checks each answer against it: status
codes and media types documented, valid data accepted, invalid data refused,
no server errors.

One check is relaxed where the schema cannot say the rule:
``positive_data_acceptance`` is skipped for the routes that take a layout (a
block, layers x heads x tokens x head_dim x itemsize, must fit in 4 GiB: a
product JSON Schema cannot bound), for the append (its body is binary frames,
docs/wire-format.md, which JSON Schema cannot describe) and for the routes that take
token ids (integers written as such: ``1.0`` and ``true`` are refused, where JSON
Schema calls ``1.0`` an integer); their refusals are
still checked for status and form. tests/reliability/test_fuzz.py fuzzes the
frames themselves.
"""


import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings
from schemathesis.specs.openapi.checks import positive_data_acceptance

from memkv.api.app import create_app
from memkv.api.auth import Authenticator, TokenEntry, hash_token

from .fakes import FakeHandle, device_and_router

SCHEMA_CANNOT_SAY = {
    ("POST", "/v1/sessions"),
    ("POST", "/v1/match"),
    ("POST", "/v1/sessions/{session_id}/turns"),
    # Token ids are integers written as such: JSON Schema calls 1.0 an integer too.
    ("POST", "/v1/sessions/{session_id}/reservations"),
    ("POST", "/v1/sessions/{session_id}/fork"),  # tail_tokens
    ("POST", "/v1/sessions/{session_id}/rewind"),  # tail_tokens
}
EXAMPLES = 40


@schemathesis.serializer("application/x-memkv-frames")
def _frames(ctx, value):  # binary bodies go as they were generated
    return value if isinstance(value, bytes) else str(value).encode()


@pytest.fixture(scope="module")
def api(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("openapi")
    device, router, loop = device_and_router(tmp / "cold", f"openapi-{tmp.name[-8:]}")
    auth = Authenticator([TokenEntry(hash_token("t"), "acme", frozenset({"write", "admin"}))])
    app = create_app(
        FakeHandle(router),
        max_body_bytes=1 << 20,
        same_node_reads=False,
        put_object=lambda payload: payload,
        auth=auth,
        body_timeout_s=5,
    )
    yield schemathesis.openapi.from_asgi("/openapi.json", app)
    device.close()
    loop.close()


#: Not fuzzed: registering an engine connects to the URL given, and generated URLs
#: name hosts off this machine (tests/api/engines/test_front_door.py drives it).
NOT_FUZZED = {("POST", "/v1/engines")}


def _fuzz(op):
    """A hypothesis test of one operation, every built-in check on (but those the schema
    cannot say)."""
    excluded = (
        [positive_data_acceptance] if (op.method.upper(), op.path) in SCHEMA_CANNOT_SAY else []
    )

    @given(case=op.as_strategy())
    @settings(max_examples=EXAMPLES, deadline=None, suppress_health_check=list(HealthCheck))
    def run(case):
        case.call_and_validate(headers={"Authorization": "Bearer t"}, excluded_checks=excluded)

    return run


def test_every_route_answers_as_its_schema_says(api):
    failures = []
    operations = [result.ok() for result in api.get_all_operations()]
    assert len(operations) >= 13
    for op in operations:
        if (op.method.upper(), op.path) in NOT_FUZZED:
            continue
        try:
            _fuzz(op)()
        except BaseException as e:  # noqa: BLE001 - hypothesis raises groups of failures
            if isinstance(e, KeyboardInterrupt):
                raise
            failures.append(f"{op.method.upper()} {op.path}: {str(e)[:1500]}")
    assert not failures, "\n\n".join(failures)
