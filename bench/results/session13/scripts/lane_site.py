# sitecustomize for the sidecars: where a POST /v1/transfers goes inside the prefill's sidecar.
import os
if os.environ.get("KVF_LANE"):
    import statistics, time
    from kvferry.api import app as _app
    from kvferry.engine import engine as _eng, blocks as _blk
    _rows, _cur = [], {}
    _orig_submit = _app.Lane._submit
    async def _submit(self, scope, receive, send, wait):
        _cur.clear(); _cur["in"] = time.perf_counter(); _cur["in_wall"] = time.time()
        await _orig_submit(self, scope, receive, send, wait)
    _app.Lane._submit = _submit
    _orig_validate = _app.TransferBody.model_validate_json
    def _validate(body, *a, **k):
        _cur["v0"] = time.perf_counter()
        try:
            return _orig_validate(body, *a, **k)
        finally:
            _cur["v1"] = time.perf_counter()
    _app.TransferBody.model_validate_json = _validate
    _orig_resolve = _blk.Blocks.resolve
    def _resolve(self, *a, **k):
        t = time.perf_counter()
        try:
            return _orig_resolve(self, *a, **k)
        finally:
            _cur.setdefault("res", 0.0)
            if "s0" in _cur and "s1" not in _cur:
                _cur["res"] += time.perf_counter() - t
    _blk.Blocks.resolve = _resolve
    _orig_esubmit = _eng.Engine.submit
    def _esubmit(self, spec):
        _cur["s0"] = time.perf_counter()
        t = _orig_esubmit(self, spec)
        _cur["s1"] = time.perf_counter()
        if "in" in _cur and "v1" in _cur:
            c = _cur
            _rows.append((c["v0"] - c["in"], c["v1"] - c["v0"], c["s0"] - c["v1"], c.get("res", 0.0),
                          c["s1"] - c["s0"] - c.get("res", 0.0), t.created - c["in_wall"]))
            if len(_rows) % 10 == 0:
                with open("/tmp/lane.txt", "a") as fh:
                    fh.write(f"{os.getpid()} body,validate,spec,resolve,submit-rest(incl. leased write),created-entry(wall) "
                             f"{[round(statistics.median(x) * 1e6) for x in zip(*_rows[-10:])]}\n")
        return t
    _eng.Engine.submit = _esubmit
