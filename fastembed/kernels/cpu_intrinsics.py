"""Operations Numba cannot express, as Numba intrinsics: three x86-64 instructions and a byte copy.

- ``stream_store_16(dst, src)``: copy 16 bytes with a non-temporal store
  (MOVNTDQ). The store bypasses the cache, so writing an output far larger
  than the last-level cache does not first read every output line into the
  cache (read-for-ownership). ``dst`` MUST be 16-byte aligned: the caller
  checks this on the host before choosing a kernel that uses it.
- ``store_fence()``: SFENCE, which orders the weakly-ordered streaming stores
  before anything the thread does next.
- ``prefetch(address)``: a read prefetch into all cache levels.
- ``copy_bytes(dst, src, n)``: copy `n` bytes with the C library's
  ``memcpy`` (LLVM's memcpy intrinsic, linked to the process's C library
  when the kernel loads; any CPU). ``dst`` and ``src`` must not overlap.

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


@intrinsic
def copy_bytes(typingctx, dst, src, n):
    def codegen(context, builder, signature, args):
        byte_pointer = ir.IntType(8).as_pointer()
        destination, source = (builder.inttoptr(address, byte_pointer) for address in args[:2])
        cgutils.raw_memcpy(builder, destination, source, args[2], 1)
        return context.get_dummy_value()

    return types.void(types.uintp, types.uintp, types.uintp), codegen
