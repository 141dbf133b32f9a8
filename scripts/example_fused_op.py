"""A new fused op in a few lines: bias + GELU + residual in the epilogue of ``x @ W.T``.

    out[m, n] = gelu_tanh(sum_k x[m, k] W[n, k] + bias[n]) + residual[m, n]      (bf16 out)

The tree below is the whole op: the kernel applies it to the fp32 accumulator while it is still
in registers (the residual tile arrives by TMA alongside), so the (M, N) pre-activation is never
written to memory. ``register_op`` makes it ``torch.ops.coda.bias_gelu_residual`` with a fake
implementation derived from the tree (``torch.compile`` / ``FakeTensorMode`` work).

    python scripts/example_fused_op.py

On a Hopper GPU this runs the kernel (compiled on first use) and compares it with the torch
evaluation of the same tree (``coda_cute.epilogue.evaluate``) and with plain torch math. Without
CUDA it runs the op's CPU reference inside ``coda_cute.reference_on_cpu()``. Exit status 1 if the
relative error exceeds 1e-2 (bf16 rounding).
"""

import contextlib

import torch

import coda_cute
from coda_cute import epilogue as E

out = E.gelu(E.acc() + E.col_vec("bias")) + E.tile("residual", "bfloat16")
tree = E.Epilogue(E.store(out, "out", "bfloat16"))
E.register_op("bias_gelu_residual", tree)  # inputs in tree.input_order(): bias, residual


def main(m=1000, n=4096, k=1024) -> int:
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    x = torch.randn(m, k, device=dev).to(torch.bfloat16)
    w = (torch.randn(n, k, device=dev) / k ** 0.5).to(torch.bfloat16)
    bias, residual = torch.randn(n, device=dev), torch.randn(m, n, device=dev).to(torch.bfloat16)
    with contextlib.nullcontext() if dev == "cuda" else coda_cute.reference_on_cpu():
        got = torch.ops.coda.bias_gelu_residual(x, w.t(), bias, residual).float()
    acc = x.float() @ w.float().t()
    oracle = E.evaluate(tree, acc, {"bias": bias, "residual": residual})["out"].float()
    plain = torch.nn.functional.gelu(acc + bias, approximate="tanh") + residual.float()
    print(f"{dev}: out {tuple(got.shape)} bf16; max |out - evaluate(tree)| = "
          f"{(got - oracle).abs().max():.3e}, max |out - torch math| = {(got - plain).abs().max():.3e}")
    return int((got - plain).norm() / plain.norm() > 1e-2)


if __name__ == "__main__":
    raise SystemExit(main())
