import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from memkv.errors import InvalidInputError, LayoutMismatchError
from memkv.storage.layout import KVLayout, block_token_count, join_blocks, split_kv


def _layout(**kw):
    base = dict(
        model_id="m", num_layers=2, num_kv_heads=2, head_dim=4, dtype="float16", block_tokens=4
    )
    base.update(kw)
    return KVLayout(**base)


def _kv(layout, tokens, batch=False):
    shape = (layout.num_kv_heads, tokens, layout.head_dim)
    if batch:
        shape = (1, *shape)
    keys = [torch.randn(shape).to(layout.torch_dtype) for _ in range(layout.num_layers)]
    values = [torch.randn(shape).to(layout.torch_dtype) for _ in range(layout.num_layers)]
    return keys, values


def test_fingerprint_is_stable_and_distinguishes_every_field():
    a = _layout()
    assert a.fingerprint == _layout().fingerprint
    assert len(a.fingerprint) == 16
    variants = [
        _layout(model_id="n"),
        _layout(num_layers=3),
        _layout(num_kv_heads=1),
        _layout(head_dim=8),
        _layout(dtype="bfloat16"),
        _layout(block_tokens=8),
    ]
    fingerprints = {v.fingerprint for v in variants} | {a.fingerprint}
    assert len(fingerprints) == len(variants) + 1


def test_fingerprint_golden_value():
    # Pinned: a changed fingerprint silently orphans every archived block.
    layout = KVLayout("llama-ref", num_layers=8, num_kv_heads=2, head_dim=64)
    assert layout.fingerprint.hex() == "823ba7cf2ad5d90a3665ffe4d44efddd"
    assert layout.block_shape() == (8, 2, 2, 256, 64)
    assert layout.block_nbytes() == 8 * 2 * 2 * 256 * 64 * 2
    assert layout.token_nbytes() * 256 == layout.block_nbytes()


@pytest.mark.parametrize(
    "kw",
    [
        {"model_id": ""},
        {"num_layers": 0},
        {"num_kv_heads": -1},
        {"head_dim": 2.5},
        {"block_tokens": True},
        {"dtype": "int8"},
    ],
)
def test_invalid_layout_fields_are_refused_by_name(kw):
    with pytest.raises(InvalidInputError) as e:
        _layout(**kw)
    assert next(iter(kw)) in str(e.value)


def test_dict_round_trip_and_unknown_fields():
    layout = _layout(dtype="bfloat16")
    assert KVLayout.from_dict(layout.to_dict()) == layout
    with pytest.raises(InvalidInputError, match="unknown layout fields"):
        KVLayout.from_dict({**layout.to_dict(), "extra": 1})
    with pytest.raises(InvalidInputError, match="incomplete"):
        KVLayout.from_dict({"model_id": "m"})


def test_block_token_count():
    layout = _layout(block_tokens=4)
    assert block_token_count(layout, 0) == []
    assert block_token_count(layout, 4) == [4]
    assert block_token_count(layout, 9) == [4, 4, 1]
    with pytest.raises(InvalidInputError):
        block_token_count(layout, -1)


@settings(max_examples=40, deadline=None)
@given(
    tokens=st.integers(min_value=1, max_value=23),
    block_tokens=st.integers(min_value=1, max_value=8),
    dtype=st.sampled_from(["float32", "float16", "bfloat16"]),
    batch=st.booleans(),
)
def test_split_join_round_trip(tokens, block_tokens, dtype, batch):
    layout = _layout(block_tokens=block_tokens, dtype=dtype)
    keys, values = _kv(layout, tokens, batch=batch)
    blocks = split_kv(layout, keys, values)
    assert [b.shape[3] for b in blocks] == block_token_count(layout, tokens)
    for b in blocks:
        assert b.is_contiguous()
        layout.check_block(b)
    k2, v2 = join_blocks(layout, blocks)
    for a, b in zip(keys, k2, strict=True):
        assert torch.equal(a.reshape(b.shape), b)
    for a, b in zip(values, v2, strict=True):
        assert torch.equal(a.reshape(b.shape), b)


def test_block_layout_is_layer_major():
    layout = _layout(block_tokens=4)
    keys, values = _kv(layout, 4)
    (block,) = split_kv(layout, keys, values)
    assert torch.equal(block[1, 0], keys[1])
    assert torch.equal(block[0, 1], values[0])


def test_split_rejects_mismatches():
    layout = _layout()
    keys, values = _kv(layout, 5)
    with pytest.raises(LayoutMismatchError, match="one per layer"):
        split_kv(layout, keys[:1], values)
    with pytest.raises(LayoutMismatchError, match="dtype float16"):
        split_kv(layout, [k.float() for k in keys], values)
    with pytest.raises(LayoutMismatchError, match="head_dim=4"):
        split_kv(layout, [torch.zeros(2, 5, 3, dtype=torch.float16)] * 2, values)
    with pytest.raises(LayoutMismatchError, match="same number of tokens"):
        split_kv(layout, keys, [v[:, :4] for v in values])
    with pytest.raises(LayoutMismatchError, match="batch size 2"):
        split_kv(layout, [torch.zeros(2, 2, 5, 4, dtype=torch.float16)] * 2, values)


def test_join_rejects_partial_block_in_the_middle_and_foreign_blocks():
    layout = _layout(block_tokens=4)
    keys, values = _kv(layout, 6)
    full, partial = split_kv(layout, keys, values)
    with pytest.raises(LayoutMismatchError, match="only the last block may be partial"):
        join_blocks(layout, [partial, full])
    with pytest.raises(LayoutMismatchError, match="dtype"):
        join_blocks(layout, [full.float()])
    with pytest.raises(LayoutMismatchError, match="5-d block"):
        join_blocks(layout, [full[0]])
    with pytest.raises(InvalidInputError):
        join_blocks(layout, [])
