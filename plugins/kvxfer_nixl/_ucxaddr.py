"""The UCX worker-address reader now lives in :mod:`kvxfer.peers.ucxaddr` (the UCX backend reads
addresses too); this name stays for the NIXL plugin's own imports."""

from kvxfer.peers.ucxaddr import (SM_DEVICE, TRANSPORTS, Address, Entry, Here, Reach, Unreadable, crc16, parse,
                                  reach, shm_owners)

__all__ = ["SM_DEVICE", "TRANSPORTS", "Address", "Entry", "Here", "Reach", "Unreadable", "crc16", "parse", "reach",
           "shm_owners"]
