"""`bench/dataflow_chain.py`'s CUDA C on the CPU (`cuda_cpu`): the chain of GEMVs a launch each and as one
launch (every CTA at once: its warps wait on each other's counters, chunk by chunk or for a whole input) give
torch's chain."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from cuda_cpu import HostKernel  # noqa: E402

from bench.dataflow_chain import Chain, run, source  # noqa: E402

SHAPES = [(512, 256), (256, 512), (768, 256), (256, 768)]
CTAS, WARPS = 3, 2


def _chain_on_cpu(dataflow: int, rpw: int, unroll: int, sync: int = 0) -> Chain:
    chain = Chain(SHAPES, "cpu", seed=rpw * 10 + unroll)
    text = source(WARPS, 1, rpw, unroll, dataflow, pdl=0, sync=sync)
    # every CTA at once (the emulator runs a cluster's CTAs together): the dataflow form's warps wait on
    # items of other CTAs
    run(HostKernel(f"#define CLUSTER {CTAS}\n" + text, "chain_gemv"), chain, CTAS, WARPS, dataflow, pdl=0)
    return chain


def _error(chain: Chain) -> float:
    ref = chain.reference()
    return ((chain.out.float() - ref).norm() / ref.norm()).item()


@pytest.mark.parametrize("dataflow,sync", [(0, 0), (1, 0), (2, 0), (1, 1), (2, 1)],
                         ids=["launches", "dataflow", "barriers", "dataflow-light", "barriers-light"])
@pytest.mark.parametrize("rpw,unroll", [(4, 4), (2, 3)])
def test_chain_matches_torch(dataflow, sync, rpw, unroll):
    chain = _chain_on_cpu(dataflow, rpw, unroll, sync)
    # fp16 outputs of fp32 sums, as the reference rounds them: only summation order differs
    assert _error(chain) < 2e-3
    if dataflow:  # every output chunk counted by each of its items
        assert (chain.counts == 256 // rpw).all()

