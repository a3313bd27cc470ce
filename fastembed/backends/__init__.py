"""The backends: one module each, all with the same small interface.

Every backend module defines:

- ``NAME``: the name users pass as ``backend=``;
- ``unavailable_reasons() -> list[str]``: why it cannot run on this machine
  at all (a missing package, no device); empty when it can. Cached: it
  describes the machine, not a call;
- ``not_supported_reasons(table, ids, out) -> list[str]``: why it cannot serve
  this particular call (for example, the data lives on another device). It
  must depend only on the table's type: ``auto`` remembers its choice per
  table type (validation has already matched ids and out to the table);
- ``gather(table, ids, out=None) -> out``: write ``table[ids]`` into ``out``
  (``None``: a new output of shape ``ids.shape + (dim,)``, allocated where
  the table lives) and return it. Inputs arrive validated (see :mod:`fastembed.validate`) except for the
  range of int32/int64 ids, which the backend checks and reports through
  :func:`fastembed.validate.out_of_range_error`, leaving ``out`` untouched.
- ``describe() -> dict``: facts for ``python -m fastembed info``.
"""
