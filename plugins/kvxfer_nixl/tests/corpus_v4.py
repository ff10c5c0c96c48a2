"""Rewrite saved NIXL fuzz inputs from blob v3 (KVXNIXL3 / KVXCUDA1) to v4 (KVXNIXL4 / KVXCUDA2): the
identity header changed, the NIXL part (what crashes NIXL) is kept byte for byte. Run from the repository root:
``python plugins/kvxfer_nixl/tests/corpus_v4.py tests/fuzz_corpus/nixl/*.bin``."""
import base64, json, struct, sys
sys.path.insert(0, "."); sys.path.insert(0, "plugins")
from kvxfer import peers
from kvxfer.peers import Identity
from kvxfer_nixl import _blob
from kvxfer.cuda import blob as cb

OLD_N = struct.Struct("<8s16s16sQI")
OLD_C = struct.Struct("<8s16sIQ16s16sHIII")
def conv(raw):
    magic, token, inst, epoch, dlen = OLD_N.unpack_from(raw)
    if magic != b"KVXNIXL3":
        return None
    dev = raw[OLD_N.size:OLD_N.size + dlen]
    rest = raw[OLD_N.size + dlen:]
    if dev[:8] == b"KVXCUDA1" and len(dev) >= OLD_C.size:
        m, boot, pid, st, tok, dinst, nd, nh, nc, na = OLD_C.unpack_from(dev)
        ident = Identity(boot if boot.strip(b"\0") else b"", pid, st, tok)
        dev = cb._HEAD.pack(cb.MAGIC, peers.encode(ident), dinst, nd, nh, nc, na) + dev[OLD_C.size:]
    else:
        ident = Identity(b"", 0, 0, token)
    ident_n = Identity(b"", 0, 0, token)  # the sender is long gone: no host claim
    return _blob.HEADER.pack(_blob.MAGIC, peers.encode(ident_n), inst, epoch, len(dev)) + dev + rest
for path in sys.argv[1:]:
    data = open(path, "rb").read()
    assert data.startswith(b"KVXFMETA"), path
    doc = json.loads(data[8:])
    new = conv(base64.b64decode(doc["blob"]))
    if new is None:
        print("left as is (older version)", path); continue
    doc["blob"] = base64.b64encode(new).decode()
    open(path, "wb").write(b"KVXFMETA" + json.dumps(doc, separators=(",", ":")).encode())
    print("converted", path)
