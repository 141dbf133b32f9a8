"""GPU test of ``torch.ops.coda.lm_head_ce_train_fp8``: its block-scaled kernels (the logits tree,
the RMSNorm-backward dgrad on the weight's FP8 transpose, the weight-gradient form accumulated in
fp32 over row chunks, the bf16 weight gradient of a ragged chunk) against float64 math next to
the bf16 op's errors, and against the reference path on the same inputs."""

import pytest
import torch

import test_lm_head_fp8_cpu as C
from coda_cute.ops import lm_head_ce as L
from helpers import rel_err

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("m, chunk_rows", [(2048, 512), (1000, 256)], ids=["fp8-wgrad-4-chunks", "ragged-last-chunk"])
def test_loss_and_gradients_next_to_the_bf16_op_and_the_reference(monkeypatch, m, chunk_rows):
    d, v = 1024, 4096
    monkeypatch.setattr(L, "CHUNK_BYTES", chunk_rows * 2 * v)
    assert L.plan_chunks(m, v, d)[0] == chunk_rows
    y, w, ss, t, gamma = C._inputs(m, d, v, 7)
    exact = C._exact(y, w, ss, t, gamma)
    cuda = [x.cuda() for x in (y, w, ss, t, gamma)]
    fp8 = [x.cpu() for x in C._run(torch.ops.coda.lm_head_ce_train_fp8, *cuda)]
    bf16 = [x.cpu() for x in C._run(torch.ops.coda.lm_head_ce_train, *cuda)]
    ref = C._run(torch.ops.coda.lm_head_ce_train_fp8, y, w, ss, t, gamma)  # the reference path
    assert abs(float(fp8[0]) - float(exact[0])) < 1e-2 * float(exact[0])
    errors = {}
    for i, name in enumerate(("dy", "dw", "dgamma"), start=1):
        assert bool(fp8[i].float().isfinite().all()), name
        e8, e16 = rel_err(fp8[i].double(), exact[i]), rel_err(bf16[i].double(), exact[i])
        errors[name] = (e8, e16, rel_err(fp8[i].double(), ref[i].double()))
        assert 2 * e16 < e8 < 0.15, errors
        # the kernels round the logits and dl' to bf16 before quantizing, the reference does not:
        # an FP8 step of some elements apart, far below the quantization error itself
        assert errors[name][2] < 0.5 * e8, errors
    print(f"lm_head fp8 errors (fp8, bf16, fp8 vs reference): {errors}")
