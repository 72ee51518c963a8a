"""Message timeline: wraps transport steps with timestamps (perf_counter, shared by processes on
one host) and dumps them at exit to $OUT/mtl_<pid>.json. Imported by msg_cost.py when KVF_MTL=1."""
import atexit, functools, json, os, time
from kvferry.transport import checksum, connection, ucx, wire

EV = []
import sys
ROLE = "recv" if "server" in sys.argv else "send"

def mark(name):
    EV.append((time.perf_counter(), name))

def wrap_async(cls, attr, name, detail=None):
    f = getattr(cls, attr)
    @functools.wraps(f)
    async def g(*a, **k):
        mark(name + ">")
        r = await f(*a, **k)
        mark(name + "<" + (detail(r, a) if detail else ""))
        return r
    setattr(cls, attr, g)

def wrap_sync(mod, attr, name):
    f = getattr(mod, attr)
    @functools.wraps(f)
    def g(*a, **k):
        mark(name + ">")
        r = f(*a, **k)
        mark(name + "<")
        return r
    setattr(mod, attr, g)

def hdr(r, a):
    try:
        return ":" + wire.unpack(r).type.name
    except Exception:
        return ""

wrap_async(ucx.UcxLink, "send", "ucx.send")
wrap_async(ucx.UcxLink, "send_rest", "ucx.send_rest")
wrap_async(ucx.UcxLink, "recv_header", "ucx.recv_header", hdr)
wrap_async(ucx.UcxLink, "_recv", "ucx._recv")
wrap_sync(checksum, "device_segmented_crc", "crc.dev")
wrap_sync(checksum, "verify", "crc.verify")
wrap_async(connection.Connection, "send", "conn.send")
wrap_async(connection.Connection, "_write_many", "conn.write_many")
orig_dispatch = connection.Connection._dispatch
async def dispatch(self, m):
    mark("dispatch>" + m.type.name)
    r = await orig_dispatch(self, m)
    mark("dispatch<" + m.type.name)
    return r
connection.Connection._dispatch = dispatch
orig_complete = connection.Connection._complete
def complete(self, receive):
    mark("complete")
    return orig_complete(self, receive)
connection.Connection._complete = complete

@atexit.register
def dump():
    out = os.environ.get("OUT", "/tmp")
    with open(os.path.join(out, f"mtl_{ROLE}.json"), "w") as f:
        json.dump(EV, f)

# Sub-steps of the device CRC (a copy of checksum.device_segmented_crc with marks).
import numpy as np
def crc_marked(payload):
    import cupy, torch, google_crc32c
    n = payload.numel()
    mark("crc.a")
    segments = -(-n // checksum.SEGMENT_BYTES)
    last = n - (segments - 1) * checksum.SEGMENT_BYTES
    device = payload.device.index if payload.device.index is not None else torch.cuda.current_device()
    stream = checksum._cupy_stream(cupy, torch.cuda.current_stream(device), device)
    mark("crc.stream")
    with cupy.cuda.Device(device), stream:
        data = cupy.asarray(payload)
        out = cupy.empty(segments, dtype=cupy.uint32)
        mark("crc.arrays")
        grid = min(-(-segments // checksum._WARPS), checksum._MAX_BLOCKS)
        checksum._kernel(device)((grid,), (32 * checksum._WARPS,), (data, np.uint64(n), np.uint64(segments), out,
                                                  checksum._tables_on_device(device), np.uint32(checksum._zeros_crc(checksum.SEGMENT_BYTES)),
                                                  np.uint32(checksum._zeros_crc(last))))
        mark("crc.launched")
        if os.environ.get("MTL_SYNC"):
            stream.synchronize()
            mark("crc.synced")
        host = out.get(stream=stream)
        mark("crc.got")
        r = google_crc32c.value(host.astype("<u4").tobytes())
        mark("crc.z")
        return r
checksum.device_segmented_crc = crc_marked
