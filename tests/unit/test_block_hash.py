from lamina.libs.block_hash import ROOT_HASH, hash_block, hash_blocks


def test_chained_hashes_depend_on_the_whole_prefix():
    a = hash_blocks([1, 2, 3, 4, 5, 6, 7, 8], block_size=4)
    b = hash_blocks([9, 2, 3, 4, 5, 6, 7, 8], block_size=4)
    assert len(a) == 2
    assert a[0] != b[0] and a[1] != b[1]  # same second window, different prefix


def test_partial_block_is_not_hashed_and_extension_is_incremental():
    tokens = list(range(10))
    full = hash_blocks(tokens, block_size=4)
    assert len(full) == 2
    assert hash_blocks(tokens[:8], 4) == full
    assert hash_blocks(tokens, 4, parent_hash=full[0], start=4) == full[1:]
    assert full[0] == hash_block(ROOT_HASH, tokens[:4])


def test_hashes_are_stable_across_processes():
    # A fixed value: the scheduler and every worker must compute exactly this.
    assert hash_block(ROOT_HASH, [1, 2, 3]) == hash_block(0, [1, 2, 3])
    assert 0 <= hash_block(ROOT_HASH, [1, 2, 3]) < 2**63
    assert hash_block(ROOT_HASH, [1, 2, 3]) == 7734876972953562849
