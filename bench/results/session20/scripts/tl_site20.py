# sitecustomize: a per-process event timeline of transfers (KVF_TL=1), for one-host runs.
import os
if os.environ.get("KVF_TL"):
    import time, functools, threading
    _fh = open(f"/tmp/kvtl/{os.getpid()}.tl", "a", buffering=1)
    def ev(name, *extra):
        _fh.write(f"{time.time()*1e6:.0f} {threading.get_ident() % 1000} {name} {' '.join(map(str, extra))}\n")
    import builtins; builtins._kvtl = ev
    def _wrap_async(cls, attr, label, arg=None):
        orig = getattr(cls, attr, None)
        if orig is None:
            ev("no-attr", attr); return
        @functools.wraps(orig)
        async def w(*a, **k):
            tag = arg(*a, **k) if arg else ""
            ev(label + "+", tag)
            try:
                return await orig(*a, **k)
            finally:
                ev(label + "-", tag)
        setattr(cls, attr, w)
    def _wrap(cls, attr, label, arg=None):
        orig = getattr(cls, attr, None)
        if orig is None:
            ev("no-attr", attr); return
        @functools.wraps(orig)
        def w(*a, **k):
            tag = arg(*a, **k) if arg else ""
            ev(label + "+", tag)
            try:
                return orig(*a, **k)
            finally:
                ev(label + "-", tag)
        setattr(cls, attr, w)
    def _late():
        try:
            from kvferry.engine import engine as E, outgoing as O, incoming as I, pipeline as P
            from kvferry.transport import connection as C
        except Exception as exc:
            ev("patch-failed", repr(exc)); return
        _wrap(E.Engine, "submit", "submit")
        _wrap(E.Engine, "bind", "bind")
        _wrap(O.Outgoing, "_announce", "announce")
        _wrap_async(O.Outgoing, "_encode_chunk", "enc", lambda self, t, c, p, s, n, i, **k: i)
        _wrap_async(O.Outgoing, "_send_chunk", "sendchunk", lambda self, c, t, i, *a, **k: i)
        _wrap(P.CodecRunner, "_timed", "codec", lambda self, d, c, cache, raw, *a, **k: f"{d}:{raw>>20}M")
        _wrap_async(C.Connection, "_write_many", "write", lambda self, msgs: sum(getattr(m, 'length', 0) for m, _ in msgs))
        _wrap_async(C._Pacer, "admit", "pace", lambda self, n: n >> 20)
        _wrap_async(I.Incoming, "_next_frame", "next", lambda self, i, t: i)
        _wrap(I.Admission, "accept", "accept")
        _wrap(I.Incoming, "_done", "rdone")
        _wrap(O.Outgoing, "_replied", "replied")
        _wrap_async(O.Outgoing, "_write_same_host", "wsh")
        _wrap(O.Outgoing, "_write_blocks", "wblocks")
        _wrap_async(C.Connection, "send_message", "sendmsg")
        _wrap(E.Engine, "_on_message", "onmsg", lambda self, c, p: p[5])
        _wrap(I.Admission, "_check", "check")
        _wrap(I.Admission, "_check_lease", "chklease")
        _wrap(E.Engine, "account", "account")
        _wrap_async(P.CodecRunner, "call", "ccall", lambda self, op, dev, raw, fn, *a, **k: raw >> 20)
        if hasattr(P.CodecRunner, "_launched"):
            _wrap_async(P.CodecRunner, "_launched", "launched", lambda self, d, c, raw, *a, **k: f"{d}:{raw>>20}M")
            from kvferry.transport import waiting as W
            _wrap_async(W, "until_ready", "until")
            C.until_ready = W.until_ready
            import kvferry.transport as T
            T.until_ready = W.until_ready
        from kvferry.codec import splitzip_gpu as SZ
        from kvferry.transport import checksum as CK
        _wrap(SZ, "read_to_host", "szsync")
        _wrap(CK, "device_segmented_crc", "crc", lambda p: p.numel() >> 20)
        _wrap(CK, "start_device_segment_crcs", "crcs", lambda p: p.numel() >> 20)
        from kvferry.transport import ucx as U
        _wrap_async(U.UcxLink, "recv_payload", "rpay", lambda self, r, c=None: len(r))
        _wrap_async(U.UcxLink, "send_rest", "srest", lambda self, parts: len(parts))
        _wrap_async(C.Connection, "_dispatch", "disp", lambda self, m: m.type.name)
    _late()
if os.environ.get("KVF_NOPOLL"):
    import kvferry.transport as _T
    _T.poller = lambda backend: None
if os.environ.get("KVF_INLINE_GPU"):
    from kvferry.engine import pipeline as _P
    _P.INLINE_GPU_BYTES = int(os.environ["KVF_INLINE_GPU"])
if os.environ.get("KVF_SEQ_SEND"):
    import numpy as _np
    from kvferry.transport import ucx as _U
    async def _seq(self, parts):
        for part in parts:
            await self._send_one(part)
    _U.UcxLink.send_rest = _seq
