"""The connector's fetch buffers: reused between steps, capped, never lent twice."""

from memkv.integrations.vllm.block_buffers import BlockBuffers


def test_buffers_are_reused_after_a_step_and_never_lent_twice():
    pool = BlockBuffers(4096, keep_bytes=3 * 4096)
    first = pool.take(2)
    more = pool.take(2)
    assert len({id(b) for b in first + more}) == 4 and pool.allocated == 4
    assert all(b.nbytes == 4096 for b in first + more)
    pool.give_back()
    again = pool.take(4)  # three kept (the cap), one new
    assert pool.allocated == 5
    assert len({id(b) for b in again}) == 4
    assert len({id(b) for b in again} & {id(b) for b in first + more}) == 3


def test_block_bytes_must_be_positive():
    import pytest

    with pytest.raises(ValueError, match="positive"):
        BlockBuffers(0, 1 << 20)
