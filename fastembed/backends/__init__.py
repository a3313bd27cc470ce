"""The backends: one object each, implementing :class:`fastembed.backends.base.Backend`.

- :mod:`.cuda_backend`: a raw CUDA kernel through CuPy, for cupy tables;
- :mod:`.numba_backend`: parallel Numba kernels, for host tables;
- :mod:`.numpy_backend`: numpy's ``take``, always available, the readable reference.

Each module defines ``BACKEND``, which the dispatcher registers
(:data:`fastembed.dispatch.BACKENDS`, in priority order). A backend declares
what it serves (:class:`~fastembed.backends.base.Capabilities`); the
dispatcher derives every "cannot serve" reason from those declarations.
"""
