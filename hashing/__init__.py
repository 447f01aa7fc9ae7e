"""Canonical, versioned content digests of multimodal items.

Same content gives the same digest in every process and on every machine
(CPU or GPU tensors, contiguous or strided); any change the model would see
gives a different one. The exact bytes hashed are defined in
``hashing._encoding`` (framing) and ``hashing._pil`` (PIL pixel layout) and
pinned by ``tests/vectors/content_v1.json``. `Encoder` and
`canonical_context` write that framing for digests built on it (an item's
identity, `omnicache.identity`).

    >>> from hashing import hash_identifier
    >>> hash_identifier("request-42", namespace="tenant-a").hex()[:16]
    '...'
"""

from hashing._algorithms import ALGORITHMS, DEFAULT_ALGORITHM, Algorithm, digest_size
from hashing._content import (
    ContentHash,
    hash_array,
    hash_array_rows,
    hash_audio,
    hash_bytes,
    hash_content,
    hash_identifier,
    hash_image,
    hash_video,
)
from hashing._encoding import SCHEME, Encoder, canonical_context

__all__ = [
    "ALGORITHMS",
    "DEFAULT_ALGORITHM",
    "SCHEME",
    "Algorithm",
    "ContentHash",
    "Encoder",
    "canonical_context",
    "digest_size",
    "hash_array",
    "hash_array_rows",
    "hash_audio",
    "hash_bytes",
    "hash_content",
    "hash_identifier",
    "hash_image",
    "hash_video",
]
