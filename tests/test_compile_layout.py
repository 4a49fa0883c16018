"""The whole-step graph of a conv net writes each activation once, in inductor's layout.

Inductor runs convolutions channels_last on CPUs. In the whole-step graph (the gradient
by torch.func inside it) an activation a convolution's backward reads was also written
NCHW, its traced layout, and copied channels_last once per convolution that read it
(pardist/compile/_layout.py). These tests compile a batch-norm conv net with inductor,
read the code it generated, and check its numbers against the eager step's.
"""

from __future__ import annotations

import re

import helpers
import pytest
import torch
from numerics import assert_close64
from torch._inductor.utils import run_and_get_code

F64 = torch.float64
ROWS = 24  # helpers.global_batch's rows: the leading size of every activation
FOUR = r"\((\d+), (\d+), (\d+), (\d+)\)"
BUFFER = re.compile(rf"empty_strided_cpu\({FOUR}, {FOUR}")  # (size, stride) of a new buffer


def _activations(code: str) -> list[tuple[tuple[int, ...], tuple[int, ...]]]:
    """(size, stride) of every 4-d buffer of the batch's rows that the graph allocates."""
    found = [tuple(map(int, m.groups())) for m in BUFFER.finditer(code)]
    return [(b[:4], b[4:]) for b in found if b[0] == ROWS and b[1] > 1 and b[2] * b[3] > 1]


def _compiled():
    """Train with compile=True (inductor); the training and its activations' buffers."""
    torch._inductor.config.compile_threads = 1
    with torch._inductor.config.patch(force_disable_caches=True):  # the code, generated now
        got, codes = run_and_get_code(
            helpers.train_pardist, "convnet", "sgd", steps=3, whole_batch=True, dtype=F64,
            compile=True,
        )  # fmt: skip
    assert len(codes) == 1  # one graph for the whole step
    return got, _activations(codes[0])


@pytest.fixture(scope="module")
def trained():
    """The compiled step's training, its activations' buffers, and the eager step's."""
    import pardist

    pardist.init()
    try:
        got, activations = _compiled()
        eager = helpers.train_pardist("convnet", "sgd", steps=3, whole_batch=True, dtype=F64)
    finally:
        pardist.shutdown()
    return got, activations, eager


def test_every_activation_is_written_once_channels_last(trained):
    _, activations, _ = trained
    assert activations, "no activation buffers found in the generated code"
    for size, stride in activations:
        channels_last = torch.empty(size).contiguous(memory_format=torch.channels_last).stride()
        assert stride == channels_last, f"activation {size} allocated with strides {stride}"
    sizes = [size for size, _ in activations]
    assert len(sizes) == len(set(sizes)), f"an activation is written more than once: {sizes}"


def test_the_graph_has_the_eager_steps_numbers(trained):
    (params, buffers, losses, _), _, eager = trained
    assert_close64(params, eager[0], "parameters")
    assert_close64(buffers, eager[1], "buffers")
    assert_close64(losses, eager[2], "losses")
