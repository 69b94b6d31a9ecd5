"""dev/trace_summary.py's split of a traced decode step into layers, on block-count sequences built here the way
laguna.cu launches them (the trace itself needs a GPU)."""
import os
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "dev"))
import trace_summary  # noqa: E402

SLIDING = [1288, 128, 1024, 256, 1024, 512]             # bf16: q/k/v/g, attention, o_proj, router, gate/up, down
FULL = [1030, 128, 768, 256, 1024, 512]                 # bf16, a full layer (48 heads) below long_from
DENSE = [1030, 128, 768, 1, 2048, 256]                  # bf16 layer 0: full, dense SwiGLU
FULL_LONG = [396, 16, 264, 48, 768, 128, 1152, 512]     # q8, a full layer past long_from: norm, flash, combine
SLIDING_Q8 = [396, 128, 1024, 128, 1152, 512]
DENSE_LONG = [396, 16, 264, 48, 768, 1, 2048, 256]      # layer 0: dense SwiGLU, its down 256 blocks


def step(layers, lm_blocks, sampler):
    blocks = [1]                                        # the embedding
    starts = []
    for layer in layers:
        starts.append(len(blocks))
        blocks += layer
    lm = len(blocks)
    return blocks + [lm_blocks] + sampler, starts, lm


# one pattern: every layer 6 grids, lm_head its own block count; two patterns: every 4th layer full with the
# long-context attention (8 grids), the rest sliding (6), and lm_head one wave of 396 blocks, like q/k/v/g's
PATTERNS = {
    "one pattern": ([DENSE] + [FULL if l % 4 == 0 else SLIDING for l in range(1, 40)], 12544),
    "two patterns, looping lm_head": ([DENSE_LONG] + [FULL_LONG if l % 4 == 0 else SLIDING_Q8 for l in range(1, 40)], 396),
}


@pytest.mark.parametrize("pattern", list(PATTERNS))
@pytest.mark.parametrize("sampler", [[1], [64, 64, 64, 64, 1, 1]], ids=["greedy", "sampling"])
def test_layers_found(pattern, sampler):
    layers, lm_blocks = PATTERNS[pattern]
    blocks, starts, lm = step(layers, lm_blocks, sampler)
    got_lm, got = trace_summary.find_layers(blocks, 40)
    assert got_lm == lm
    assert [idx[0] for idx in got] == starts
    assert [len(idx) for idx in got] == [len(layer) for layer in layers]


def test_no_split_when_the_count_is_wrong():
    blocks, _, _ = step([SLIDING_Q8] * 39 + [FULL_LONG], 396, [1])
    assert trace_summary.find_layers(blocks, 41)[1] is None
