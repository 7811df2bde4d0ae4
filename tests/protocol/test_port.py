"""The block port's control frames and a read response's headers, typed
(memkv.protocol.port, memkv.protocol.frame_headers): decoded once, a wrong field
named, and what the gateway must do after each bad request (answer, or close)."""

import msgpack
import pytest

from memkv.protocol.frame_headers import BlockHeader, EndHeader, decode_response_header
from memkv.protocol.port import (
    AppendRequest,
    BadRequest,
    Hello,
    PingRequest,
    PortOp,
    ReadKeysRequest,
    ReadRequest,
    Reply,
    Welcome,
    decode_control,
    decode_request,
    port_frame,
)
from memkv.protocol.wire import PREFIX_BYTES, WireError, decode_header


def _header(frame):
    raw = b"".join(bytes(c) for c in frame)
    return decode_header(raw[PREFIX_BYTES:], 0)[0]


def test_requests_round_trip_through_their_frames_tagged_by_op():
    sent = [AppendRequest(id=1, session_id="s", body_bytes=10),
            ReadRequest(id=2, session_id="s", start=3, end=None, turn=4),
            ReadKeysRequest(id=3, keys=[b"k" * 16], namespace="public"),
            PingRequest(id=4)]
    for request in sent:
        header = _header(port_frame(request))
        assert header["kind"] == "request" and header["op"] == request.op.value
        assert decode_request(header) == request
    assert [r.op for r in sent] == [PortOp.APPEND, PortOp.READ, PortOp.READ_KEYS, PortOp.PING]
    for control in (Hello(v=1, token="tok"), Welcome(v=1, tenant="t", max_body_bytes=5),
                    Reply(id=7, status=404, error={"type": "NotFound"}, close=True)):
        assert decode_control(_header(port_frame(control))) == control


@pytest.mark.parametrize(("header", "fatal", "named"), [
    # No valid id: the stream's position is unknown, the connection closes.
    ({"kind": "request", "op": "ping"}, True, "'id'"),
    ({"kind": "request", "id": True, "op": "ping"}, True, "'id'"),
    ({"kind": "reply", "id": 1, "op": "ping"}, True, "'request'"),
    # An append whose body length is unknown cannot be skipped either.
    ({"kind": "request", "id": 1, "op": "append", "session_id": "s", "body_bytes": "10"},
     True, "$.body_bytes"),
    # The rest is answered and the connection goes on.
    ({"kind": "request", "id": 1, "op": "nonsense"}, False, "unknown op"),
    ({"kind": "request", "id": 1, "op": "read"}, False, "session_id"),
    ({"kind": "request", "id": 1, "op": "read", "session_id": "s", "start": -1}, False,
     "$.start"),
    ({"kind": "request", "id": 1, "op": "read_keys", "keys": ["not bytes"]}, False,
     "$.keys[0]"),
])
def test_a_bad_request_names_its_field_and_says_whether_the_connection_can_go_on(
        header, fatal, named):
    with pytest.raises(BadRequest) as bad:
        decode_request(header)
    assert bad.value.fatal is fatal and named in str(bad.value)
    assert bad.value.request_id == (None if fatal and header.get("op") != "append" else 1)


def test_response_headers_decode_from_their_bytes_and_refuse_what_is_wrong():
    block = {"kind": "block", "index": 2, "key": b"k" * 16, "dtype": "float16",
             "shape": [1, 2, 1, 4, 8], "nbytes": 128, "crc32": 7, "tier": 1, "exact": True}
    decoded = decode_response_header(msgpack.packb(block, use_bin_type=True))
    assert isinstance(decoded, BlockHeader)
    assert (decoded.index, decoded.tier_name, decoded.lossy_name) == (2, "warm", "")
    assert decode_response_header(msgpack.packb({"kind": "end", "count": 3})) == \
        EndHeader(count=3)
    for bad, named in (({**block, "shape": [1, -2]}, "$.shape[1]"),
                       ({**block, "key": "text"}, "$.key"),
                       ({"kind": "turn"}, "$.kind")):
        with pytest.raises(WireError, match=named.replace("$", r"\$").replace("[", r"\[")):
            decode_response_header(msgpack.packb(bad, use_bin_type=True))
    with pytest.raises(WireError, match="not valid msgpack"):
        decode_response_header(b"\xc1")
