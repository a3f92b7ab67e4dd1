"""A probe of Python's collector in ``pdpool router`` processes, for the router overhead benchmark (not part of
pdpool; imported by Python at start-up from PYTHONPATH as ``sitecustomize``).

    PROBE_OUT=$OUT/gc PYTHONPATH=$PWD/benchmarks/router_gc_probe python3 benchmarks/router_overhead.py ...
    PROBE_FREEZE=1 ...   # also gc.freeze() 4 s after start, and 4 s after a fork in each worker

Only processes started as ``... router ...`` are probed (the stubs, Redis and the load generator are not). Each
writes ``$PROBE_OUT/<pid>.txt``: one line per collection that took 1 ms or more (wall time from the collector's
start callback to its stop callback: generation, ms, objects collected), and every 5 s the count of collections
per generation and the frozen objects (each worker of `--workers N` writes its own file).
"""
import gc, os, sys, threading, time
_out = os.environ.get("PROBE_OUT")
if _out and sys.argv[1:2] == ["router"]:
    os.makedirs(_out, exist_ok=True)
    _t, _n = {}, [0, 0, 0]
    def _path():
        return f"{_out}/{os.getpid()}.txt"
    def _cb(phase, info):
        if phase == "start":
            _t["t"] = time.perf_counter()
            return
        g = info["generation"]
        _n[g] += 1
        dt = (time.perf_counter() - _t.get("t", time.perf_counter())) * 1e3
        if dt >= 1.0:
            with open(_path(), "a") as f:
                f.write(f"{time.time():.3f} gen{g} {dt:.2f} collected={info['collected']}\n")
    def _counts():
        with open(_path(), "a") as f:
            f.write(f"counts {_n} frozen={gc.get_freeze_count()} argv={' '.join(sys.argv[:3])}\n")
    gc.callbacks.append(_cb)
    if os.environ.get("PROBE_FREEZE") == "1":
        def _freeze_later():
            t = threading.Timer(4.0, gc.freeze)
            t.daemon = True
            t.start()
        _freeze_later()
        os.register_at_fork(after_in_child=_freeze_later)
    # counts: written every 5 s (processes are killed, atexit may not run)
    def _tick():
        while True:
            time.sleep(5)
            _counts()
    def _start_tick():
        threading.Thread(target=_tick, daemon=True).start()
    _start_tick()
    os.register_at_fork(after_in_child=_start_tick)
