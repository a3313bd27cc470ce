"""What the ranks agree on: fingerprints of a call, error codes, the error every rank raises, and the error
of a failed collective."""

from __future__ import annotations

import hashlib
from typing import Any

#: Exception types a rank's local step shares with the others by their index (+1); any other becomes a RuntimeError.
_SHARED = (IndexError, ValueError, TypeError, FileNotFoundError, PermissionError, OSError, MemoryError, ImportError)


class CommunicationError(RuntimeError):
    """A collective of :class:`VocabParallelEmbedding` failed or timed out.

    Another rank died, hung, or stopped calling. The process group is unusable
    afterwards (a collective may still be pending in it): destroy it and end
    the process; a launcher (torchrun) then stops or restarts the job. Every
    later call of the same layer raises this error again at once.
    """


def errno_of(error: Exception) -> int:
    """An OSError's errno, to travel with its status (0 when it has none that fits an int64: OSError("a", "b")'s is "a")."""
    number = getattr(error, "errno", None)
    return number if type(number) is int and 0 < number < 2**63 else 0


def fingerprint(*parts: Any) -> int:
    """A 64-bit hash of the parts' bytes, as a signed int64 (a tensor element)."""
    hasher = hashlib.blake2b(digest_size=8)
    for part in parts:
        hasher.update(part)
    return int.from_bytes(hasher.digest(), "little", signed=True)


def error_code(error: BaseException) -> int:
    for index, kind in enumerate(_SHARED):
        if isinstance(error, kind):
            return index + 1
    return len(_SHARED) + 1


def shared_error(codes: list[int], texts: list[str], what: str, requirement: str, numbers: list[int]) -> Exception:
    """The one error every rank raises, from every rank's status code, text and (for an OSError) errno."""
    world_size = len(codes)
    failed = [rank for rank, code in enumerate(codes) if code]
    if not failed:
        listed = "; ".join(f"rank {rank}: {text}" for rank, text in enumerate(texts))
        return ValueError(f"VocabParallelEmbedding: the ranks disagree on {what}: {requirement} ({listed})")
    first = failed[0]
    kind = _SHARED[codes[first] - 1] if codes[first] <= len(_SHARED) else RuntimeError
    same = [rank for rank in failed if codes[rank] == codes[first] and texts[rank] == texts[first]]
    if len(same) == world_size:
        shared = kind(texts[first])
    else:
        ranks = f"rank {same[0]}" if len(same) == 1 else f"ranks {', '.join(map(str, same))}"
        shared = kind(f"{texts[first]} (on {ranks} of {world_size})")
    if isinstance(shared, OSError) and numbers[first]:
        shared.errno = numbers[first]  # ENOSPC stays testable on every rank
    return shared
