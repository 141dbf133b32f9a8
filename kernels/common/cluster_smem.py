"""Reads of a peer CTA's shared memory within a cluster (distributed shared memory), which the
DSL's tensors do not load from: the address mapped with ``mapa``, then one ``ld.shared::cluster``."""

from __future__ import annotations

from cutlass import Float32, Int32
from cutlass._mlir.dialects import llvm, nvvm
from cutlass.cutlass_dsl import T, dsl_user_op

#: LLVM's address space of ``shared::cluster``
DSMEM = 7


@dsl_user_op
def load_peer_f32(smem_ptr, rank, *, loc=None, ip=None) -> Float32:
    """The fp32 at ``smem_ptr`` (this CTA's shared memory) in the shared memory of cluster CTA
    ``rank``. Ordering is the caller's: a cluster barrier between the peer's store and this load."""
    remote = nvvm.mapa(llvm.PointerType.get(DSMEM), smem_ptr.to_llvm_ptr(loc=loc, ip=ip),
                       Int32(rank).ir_value(loc=loc, ip=ip), loc=loc, ip=ip)
    return Float32(llvm.load(T.f32(), remote, loc=loc, ip=ip))
