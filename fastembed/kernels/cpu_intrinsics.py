"""Three x86-64 instructions Numba cannot express, as Numba intrinsics.

- ``stream_store_16(dst, src)``: copy 16 bytes with a non-temporal store
  (MOVNTDQ). The store bypasses the cache, so writing an output far larger
  than the last-level cache does not first read every output line into the
  cache (read-for-ownership). ``dst`` MUST be 16-byte aligned: the caller
  checks this on the host before choosing a kernel that uses it.
- ``store_fence()``: SFENCE, which orders the weakly-ordered streaming stores
  before anything the thread does next.
- ``prefetch(address)``: a read prefetch into all cache levels.

Addresses are plain integers (``array.ctypes.data + offset``).
"""
from __future__ import annotations

from llvmlite import ir
from numba.core import cgutils, types
from numba.extending import intrinsic

_I32 = ir.IntType(32)
_VEC16 = ir.VectorType(ir.IntType(64), 2)


@intrinsic
def stream_store_16(typingctx, dst, src):
    def codegen(context, builder, signature, args):
        pointer = _VEC16.as_pointer()
        value = builder.load(builder.inttoptr(args[1], pointer), align=1)
        store = builder.store(value, builder.inttoptr(args[0], pointer), align=16)
        store.set_metadata("nontemporal", builder.module.add_metadata([_I32(1)]))
        return context.get_dummy_value()

    return types.void(types.uintp, types.uintp), codegen


@intrinsic
def store_fence(typingctx):
    def codegen(context, builder, signature, args):
        fence = cgutils.get_or_insert_function(
            builder.module, ir.FunctionType(ir.VoidType(), []), "llvm.x86.sse.sfence"
        )
        builder.call(fence, [])
        return context.get_dummy_value()

    return types.void(), codegen


@intrinsic
def prefetch(typingctx, address):
    def codegen(context, builder, signature, args):
        byte_pointer = ir.IntType(8).as_pointer()
        llvm_prefetch = cgutils.get_or_insert_function(
            builder.module,
            ir.FunctionType(ir.VoidType(), [byte_pointer, _I32, _I32, _I32]),
            "llvm.prefetch.p0",
        )
        # (address, read=0, locality=3 (keep in all levels), data cache=1)
        builder.call(llvm_prefetch, [builder.inttoptr(args[0], byte_pointer), _I32(0), _I32(3), _I32(1)])
        return context.get_dummy_value()

    return types.void(types.uintp), codegen
