"""The kit's face of :mod:`kvxfer._peer`: plugin and kvxfer tests import it from here.

kvxfer's own command line uses it too, so it lives outside the kit.
"""

# face written by issue 32's rename script
from .._peer import (  # noqa: F401
    PeerProcess,
    InProcessPeer,
    PeerError,
    main,
    TOKEN_ENV,
    handle,
    spawn_args,
)

__all__ = [
    "PeerProcess",
    "InProcessPeer",
    "PeerError",
    "main",
    "TOKEN_ENV",
    "handle",
    "spawn_args",
]

if __name__ == "__main__":
    main()
