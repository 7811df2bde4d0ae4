"""The client's block reader against hand-made responses: cut streams and bad checksums."""

import socket
import threading

import msgpack
import numpy as np
import pytest

from memkv.client import Client
from memkv.errors import InvalidInputError
from memkv.protocol.checksum import crc32
from memkv.protocol.wire import BlockFrameTemplate, end_frame


def _body(blocks, *, bad_crc=False, cut=0, count=None):
    parts = []
    for i, arr in enumerate(blocks):
        t = BlockFrameTemplate(
            index=i, key=bytes([i]) * 16, dtype="float16", shape=arr.shape, nbytes=arr.nbytes
        )
        crc = crc32(arr.tobytes()) ^ (1 if bad_crc else 0)
        parts += [bytes(t.fill(tier="warm", exact=False, crc=crc, lossy="int8")), arr.tobytes()]
    parts.append(end_frame(len(blocks) if count is None else count))
    body = b"".join(parts)
    return body[: len(body) - cut] if cut else body


class OneShotServer:
    """Answers one HTTP request with a fixed body and a Content-Length of the *whole* body."""

    def __init__(self, body: bytes, declared: int) -> None:
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.port = self.sock.getsockname()[1]
        self.body, self.declared = body, declared
        self.thread = threading.Thread(target=self._serve, daemon=True)
        self.thread.start()

    def _serve(self) -> None:
        conn, _ = self.sock.accept()
        with conn:
            conn.recv(65536)
            head = (
                "HTTP/1.1 200 OK\r\ncontent-type: application/x-memkv-frames\r\n"
                f"content-length: {self.declared}\r\n\r\n"
            ).encode()
            conn.sendall(head + self.body)
        self.sock.close()


def _read(body: bytes, declared: int | None = None):
    server = OneShotServer(body, len(body) if declared is None else declared)
    with Client(f"http://127.0.0.1:{server.port}", retries=0, block_port=False) as client:
        return list(client.read_blocks("s"))


def _blocks():
    rng = np.random.default_rng(0)
    return [rng.standard_normal((1, 2, 1, 4, 8)).astype(np.float16) for _ in range(3)]


def test_a_whole_stream_reads_back_with_tier_and_exactness():
    blocks = _blocks()
    got = _read(_body(blocks))
    assert [g.array.tobytes() for g in got] == [b.tobytes() for b in blocks]
    assert {g.tier for g in got} == {"warm"} and not any(g.exact for g in got)
    assert {g.lossy for g in got} == {"int8"} and "max|x| / 254" in got[0].bound


def test_a_cut_stream_is_an_error_not_a_short_read():
    body = _body(_blocks())
    with pytest.raises(InvalidInputError, match="cut"):
        _read(body[:-200], declared=len(body))


def test_a_bad_checksum_is_an_error():
    with pytest.raises(InvalidInputError, match="checksum"):
        _read(_body(_blocks(), bad_crc=True))


def test_an_end_frame_with_the_wrong_count_is_an_error():
    with pytest.raises(InvalidInputError, match="end frame"):
        _read(_body(_blocks(), count=5))


def test_headers_patch_in_place():
    t = BlockFrameTemplate(
        index=7, key=b"k" * 16, dtype="bfloat16", shape=(1, 2, 1, 4, 8), nbytes=128
    )
    for tier in ("hot", "warm", "cold"):
        for exact, lossy in ((True, ""), (False, "float16"), (False, "delta_rl")):
            for crc in (0, 1, 2**32 - 1):
                prefix = t.fill(tier=tier, exact=exact, crc=crc, lossy=lossy)
                h = msgpack.unpackb(bytes(prefix[8:]))
                assert (h["tier"], h["exact"], h["crc32"], h["index"], h["lossy"]) == (
                    {"hot": 0, "warm": 1, "cold": 2}[tier],
                    exact,
                    crc,
                    7,
                    {"": 0, "float16": 1, "delta_rl": 3}[lossy],
                )


class _Trickle:
    """A response that hands over at most ``piece`` bytes per readinto (a socket's way)."""

    def __init__(self, data: bytes, piece: int) -> None:
        self.data, self.piece, self.at = data, piece, 0

    def readinto(self, view: memoryview) -> int:
        n = min(len(view), self.piece, len(self.data) - self.at)
        view[:n] = self.data[self.at : self.at + n]
        self.at += n
        return n

    def read(self, n: int) -> bytes:
        out = self.data[self.at : self.at + n]
        self.at += len(out)
        return out


@pytest.mark.parametrize("piece", [1000, 300_000, 1 << 30])
def test_a_block_is_checksummed_as_it_arrives_in_any_pieces(piece):
    """The CRC32 made step by step while reading equals the whole block's; a flipped
    byte anywhere, the first step's or the last's, is caught."""
    from memkv.client.frames import RECEIVE_CRC_STEP, read_block_frames
    from memkv.protocol.wire import WireError

    arr = np.random.default_rng(5).standard_normal(3 * RECEIVE_CRC_STEP // 2 + 7).astype(
        np.float16)
    got = list(read_block_frames(_Trickle(_body([arr]), piece)))
    assert len(got) == 1 and got[0].array.tobytes() == arr.tobytes()
    start = len(_body([arr])) - arr.nbytes - len(end_frame(1))  # the payload's first byte
    for where in (start + 5, start + arr.nbytes - 3):
        body = bytearray(_body([arr]))
        body[where] ^= 0xFF  # a payload byte after its checksum was made
        with pytest.raises(WireError, match="checksum"):
            list(read_block_frames(_Trickle(bytes(body), piece)))
