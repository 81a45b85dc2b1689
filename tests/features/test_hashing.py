import numpy as np
import pytest
import xxhash

from features.hashing import SIGN_SEED, cross_signs, hash_values, shard_of, sign, xxh64_strings

# Pinned forever: changing any of these changes every trained model's rows.
KNOWN_SIGNS = [
    (1, "", 0x00010400F5027930),
    (1, "05db9164", 0x00011EFCC76DB114),
    (2, "05db9164", 0x00021EFCC76DB114),
    (14, "e5ba7672", 0x000EE4685465ED18),
    (26, "99e71d4d", 0x001A66B9E00D4A8A),
    (5, "14", 0x00058DEE2559A00E),
    (1, "héllo wörld", 0x0001322564219872),
    (3, "𝄞 clef", 0x000327A2410CA073),
    (65535, "max slot", 0xFFFF2C802B01BD8C),
    (7, "x" * 40, 0x0007568B38AF8E17),
]


@pytest.mark.parametrize(("slot", "value", "expected"), KNOWN_SIGNS)
def test_known_signs_are_stable(slot, value, expected):
    assert sign(slot, value) == expected


def test_vectorised_equals_scalar_and_reference_xxh64():
    rng = np.random.default_rng(0)
    alphabet = list("abcdefXYZ019 éü€𝄞")
    values = ["".join(rng.choice(alphabet, size=rng.integers(0, 70))) for _ in range(300)]
    ours = xxh64_strings(np.array(values))
    ref = [xxhash.xxh64(v.encode("utf-8"), seed=SIGN_SEED).intdigest() for v in values]
    assert ours.tolist() == ref
    signs = hash_values(np.array(values), 9)
    assert signs.tolist() == [sign(9, v) for v in values]


def test_per_value_slot_ids_and_slot_prefix():
    vals = np.array(["a", "a", "b"])
    out = hash_values(vals, np.array([1, 2, 3]))
    assert out[0] != out[1]  # same string, different slots
    assert [int(x) >> 48 for x in out] == [1, 2, 3]
    with pytest.raises(ValueError):
        hash_values(vals, 0)
    with pytest.raises(ValueError):
        hash_values(vals, np.array([1, 2]))


def test_empty_strings_array():
    assert hash_values(np.array(["", ""]), 4).tolist() == [sign(4, "")] * 2


def test_shard_of_is_balanced_and_deterministic():
    signs = hash_values(np.array([f"v{i}" for i in range(20000)]), 3)
    shards = shard_of(signs, 4)
    assert shards.min() == 0 and shards.max() == 3
    assert np.bincount(shards).min() > 4500
    assert (shard_of(signs, 4) == shards).all()
    with pytest.raises(ValueError):
        shard_of(signs, 0)


def test_cross_signs_carry_the_cross_slot():
    a = hash_values(np.array(["x", "y"]), 1)
    b = hash_values(np.array(["p", "p"]), 2)
    c = cross_signs(a, b, 30)
    assert c[0] != c[1] and all(int(x) >> 48 == 30 for x in c)
    assert (cross_signs(a, b, 30) == c).all()


def test_joined_fast_path_equals_array_path():
    from features.hashing import hash_str_list

    values = ["", "a", "b\x00c", "é€𝄞", "x" * 50, "05db9164"]  # NUL inside a value -> fallback path
    ids = np.arange(1, len(values) + 1)
    assert hash_str_list(values, ids).tolist() == hash_values(np.array(values), ids).tolist()
    assert (
        hash_str_list(values[:2] + values[3:], 4).tolist()
        == hash_values(np.array(values[:2] + values[3:]), 4).tolist()
    )
    assert hash_str_list([], 4).tolist() == []
    with pytest.raises(ValueError):
        hash_str_list(["a", 1], 4)


def test_columns_fast_path_equals_array_path():
    from features.hashing import hash_str_columns

    cols = [["05db9164", "", "é€𝄞"], ["x" * 50, "a", "b"]]
    want = hash_values(np.array(cols[0] + cols[1]), np.repeat([3, 9], 3))
    assert hash_str_columns(cols, [3, 9]).tolist() == want.tolist()
    for bad in ([["a", 1], ["b", "c"]], [["a\x00b"], ["c"]], [["a", "b"], ["c"]]):
        with pytest.raises(ValueError):
            hash_str_columns(bad, [3, 9])
    assert hash_str_columns([[], []], [3, 9]).tolist() == []
