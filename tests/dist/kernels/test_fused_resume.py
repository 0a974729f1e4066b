"""Bit-exact resume with the fused kernels on: the kernels are deterministic (fixed partial-sum
blocks, sums in a fixed order), so a killed and resumed run equals an uninterrupted one."""

import numpy as np

from support.ckpt_runs import final_params, losses, run

# dp=2 with LAMB: the sharded multi-tensor step and its all-reduced norms, plus every model op
FUSED = ("model.fused_kernels=on", "optim.name=lamb", "model.norm=layernorm", "model.mlp_bias=true")


def test_killed_and_resumed_fused_run_is_bitwise_identical(tmp_path, corpus_cache):
    run(tmp_path, corpus_cache, "straight", *FUSED)
    run(tmp_path, corpus_cache, "b", *FUSED, "checkpoint.async_save=false", faults="kill:rank=0:step=6", expect=137)
    out = run(tmp_path, corpus_cache, "b", *FUSED)
    assert "resumed from step 4" in out.stderr
    assert losses(tmp_path, "b") == losses(tmp_path, "straight")
    want, got = final_params(tmp_path / "straight" / "checkpoints"), final_params(tmp_path / "b" / "checkpoints")
    assert want.keys() == got.keys() and "layers.0.mlp.fc_bias" in want
    for name in want:
        assert np.array_equal(want[name], got[name]), name
