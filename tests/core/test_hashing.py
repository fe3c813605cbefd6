import numpy as np
import pytest
import xxhash

from halfmoon.core.hashing import NONE_HASH, hash_blocks


def _reference_chain(tokens, block_size, parent=NONE_HASH):
    """Straightforward (slow) statement of the chaining rule."""
    out = []
    prev = parent.to_bytes(16, "little")
    for start in range(0, len(tokens), block_size):
        chunk = np.asarray(tokens[start : start + block_size], dtype="<u4").tobytes()
        prev = xxhash.xxh3_128_digest(prev + chunk)
        out.append(int.from_bytes(prev, "little"))
    return out


@pytest.mark.parametrize("num_tokens", [0, 1, 15, 16, 17, 48, 100])
def test_matches_reference_rule(num_tokens):
    tokens = list(range(7, 7 + num_tokens))
    got = hash_blocks(tokens, 16)
    assert list(got.hashes) == _reference_chain(tokens, 16)
    assert got.num_tokens == num_tokens
    assert got.last_is_partial == (num_tokens % 16 != 0)
    assert got.num_full_blocks == num_tokens // 16
    assert len(got.full) == num_tokens // 16


def test_shared_prefix_shares_hashes_and_divergence_breaks_chain():
    a = list(range(64))
    b = list(range(32)) + [999] + list(range(33, 64))
    ha, hb = hash_blocks(a, 16).hashes, hash_blocks(b, 16).hashes
    assert ha[:2] == hb[:2]
    assert ha[2] != hb[2]
    # chaining: identical block content after a divergence still hashes differently
    assert ha[3] != hb[3]


def test_parent_continues_chain():
    tokens = list(range(64))
    whole = hash_blocks(tokens, 16).hashes
    first = hash_blocks(tokens[:32], 16).hashes
    rest = hash_blocks(tokens[32:], 16, parent=first[-1]).hashes
    assert whole == first + rest


def test_block_position_matters():
    same = [5] * 32
    h = hash_blocks(same, 16).hashes
    assert h[0] != h[1]


def test_numpy_and_list_inputs_agree():
    arr = np.arange(1000, dtype=np.int64)
    assert hash_blocks(arr, 16) == hash_blocks(arr.tolist(), 16)


@pytest.mark.parametrize(
    "tokens,block_size,msg",
    [([1, 2], 0, "block_size"), ([-1], 16, "token ids"), ([[1, 2]], 16, "one-dimensional")],
)
def test_bad_input(tokens, block_size, msg):
    with pytest.raises(ValueError, match=msg):
        hash_blocks(tokens, block_size)


def test_cache_salt_roots_a_disjoint_chain():
    from halfmoon.core.hashing import chain_root

    tokens = list(range(100))  # 6 full blocks and a partial one
    plain = hash_blocks(tokens, 16).hashes
    assert chain_root(None) == NONE_HASH
    assert hash_blocks(tokens, 16, chain_root(None)).hashes == plain  # unsalted: unchanged
    salted = hash_blocks(tokens, 16, chain_root("tenant-a")).hashes
    assert list(salted) == _reference_chain(tokens, 16, chain_root("tenant-a"))
    assert all(s != p for s, p in zip(salted, plain, strict=True))  # block 0 and after
    assert not set(salted) & set(plain)
    again = hash_blocks(tokens, 16, chain_root("tenant-a")).hashes
    assert again == salted  # the same salt shares everything
    other = hash_blocks(tokens, 16, chain_root("tenant-b")).hashes
    assert not set(other) & set(salted)
    # Salted prompts with a shared prefix still share its blocks, and only those.
    longer = hash_blocks(tokens[:48] + [7] * 52, 16, chain_root("tenant-a")).hashes
    assert longer[:3] == salted[:3] and longer[3] != salted[3]
    assert chain_root("é") != chain_root("e") and 0 <= chain_root("x") < 2**128


@pytest.mark.parametrize("salt", ["", 5, b"bytes"])
def test_bad_cache_salt(salt):
    from halfmoon.core.hashing import chain_root

    with pytest.raises(ValueError, match="cache_salt"):
        chain_root(salt)


def test_adapter_salt_marks_the_chain_once():
    from halfmoon.core.hashing import adapter_salt, chain_root

    assert adapter_salt(None, None) is None and adapter_salt("t", None) == "t"
    a, a_t, b = adapter_salt(None, "a"), adapter_salt("t", "a"), adapter_salt(None, "b")
    assert len({chain_root(s) for s in (None, "t", a, a_t, b)}) == 5  # five disjoint chains
    assert adapter_salt(a, "a") == a and adapter_salt(a_t, "a") == a_t  # idempotent
    assert a_t.endswith("t")
    for salt, lora in [(a, None), (a, "b"), (a_t, "b"), ("x\x1fy", None), (a + "\x1f", "a")]:
        with pytest.raises(ValueError, match="U\\+001F"):  # no salt borrows or drops a mark
            adapter_salt(salt, lora)
