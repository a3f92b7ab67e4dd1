"""A probe of event-loop stalls in ``pdpool router`` processes, for the router overhead benchmark (not part of
pdpool; imported by Python at start-up from PYTHONPATH as ``sitecustomize``).

    PROBE_OUT=$OUT/lag PYTHONPATH=$PWD/benchmarks/router_lag_probe python3 benchmarks/router_overhead.py ...

In each process started as ``... router ...`` (each worker of ``--workers N`` too), it writes ``$PROBE_OUT/<pid>.txt``:
- ``lag T MS``: the event loop ran a 1 ms sleep MS ms late (4 ms or more), followed by ``s`` lines: the main
  thread's innermost four Python frames, sampled every 2 ms by a thread, over the late interval;
- ``gc T genN MS``: a collection of 1 ms or more;
- ``sched T ...`` every second: the main thread's CPU ms, its run-queue wait ms (``/proc/.../schedstat``), the
  CPU it last ran on, minor and major page faults, and the process's RSS in MB.
The loop is wrapped through ``uvloop.run`` (the router's loop when uvloop is installed). ``PROBE_SWITCH_S=S``
also sets the interpreter's GIL switch interval (``sys.setswitchinterval``, default 0.005 s) in those processes.

Variants for an A/B of the router's other threads as the cause of the stalls (each a change to the probed process
only, not to pdpool):
- ``PROBE_SAMPLE=0``: no frame-sampling thread (it takes the GIL every 2 ms itself);
- ``PROBE_QUIET=1``: the ``pdpool.router`` loggers at WARNING, so no per-request line is made and the log writer
  thread (``router/log_lines.py``) never wakes;
- ``PROBE_SYNC_LOG=1``: the per-request lines are made as shipped but written by the event loop's thread at once,
  and the log writer thread exits: the same work with no second thread taking the GIL.
"""
import collections, gc, os, sys, threading, time
_out = os.environ.get("PROBE_OUT")
if _out and sys.argv[1:2] == ["router"]:
    os.makedirs(_out, exist_ok=True)
    _lines = []
    _ring = collections.deque(maxlen=200)
    _main = threading.main_thread().ident
    def _w(s):
        _lines.append(s)
    def _flush():
        prev = None
        while True:
            time.sleep(1.0)
            try:
                with open(f"/proc/self/task/{_main_native}/schedstat") as f:
                    run_ns, wait_ns, slices = map(int, f.read().split())
                st = open('/proc/self/stat').read().rsplit(')', 1)[1].split()
                minflt, majflt = int(st[7]), int(st[9])
                rss_mb = int(open('/proc/self/statm').read().split()[1]) * 4096 / 2**20
                if prev is not None:
                    _w(f"sched {time.time():.3f} cpu_ms {(run_ns - prev[0]) / 1e6:.1f} wait_ms {(wait_ns - prev[1]) / 1e6:.1f} slices {slices - prev[2]} cpu {st[36]} minflt {minflt - prev[3]} majflt {majflt - prev[4]} rss_mb {rss_mb:.0f}")
                prev = (run_ns, wait_ns, slices, minflt, majflt)
            except OSError:
                pass
            if _lines:
                chunk = _lines[:]
                del _lines[:len(chunk)]
                with open(f"{_out}/{os.getpid()}.txt", "a") as f:
                    f.write("\n".join(chunk) + "\n")
    def _sample():
        while True:
            time.sleep(0.002)
            fr = sys._current_frames().get(_main)
            st = []
            while fr is not None and len(st) < 4:
                st.append(f"{os.path.basename(fr.f_code.co_filename)}:{fr.f_lineno}:{fr.f_code.co_name}")
                fr = fr.f_back
            _ring.append((time.time(), "<".join(st)))
    _t = {}
    def _cb(phase, info):
        if phase == "start":
            _t["t"] = time.perf_counter()
        else:
            dt = (time.perf_counter() - _t.get("t", 0)) * 1e3
            if dt >= 1.0:
                _w(f"gc {time.time():.4f} gen{info['generation']} {dt:.2f}")
    gc.callbacks.append(_cb)
    async def _lag():
        import asyncio
        prev = time.perf_counter()
        while True:
            await asyncio.sleep(0.001)
            now = time.perf_counter()
            late = (now - prev - 0.001) * 1e3
            prev = now
            if late >= 4.0:
                t = time.time()
                _w(f"lag {t:.4f} {late:.1f}")
                for ts, st in list(_ring):
                    if t - late / 1e3 - 0.003 <= ts <= t:
                        _w(f"  s {ts:.4f} {st}")
    def _threads():
        global _main, _main_native
        _main = threading.get_ident()
        _main_native = threading.get_native_id()
        threading.Thread(target=_flush, daemon=True).start()
        if os.environ.get("PROBE_SAMPLE", "1") != "0":
            threading.Thread(target=_sample, daemon=True).start()
    if os.environ.get("PROBE_QUIET") == "1":
        import logging
        logging.getLogger("pdpool.router").setLevel(logging.WARNING)
    def _sync_log():
        import logging
        from pdpool.router.log_lines import BufferedLineHandler
        for h in logging.getLogger().handlers:
            if isinstance(h, BufferedLineHandler):
                h.flush()
                h._closed = True          # its writer thread exits at its next wake-up; emit() flushes at once
                h._pending.set()
                def add_line(line, h=h):
                    with h.lock:
                        h.stream.write(line)
                        h.stream.flush()
                h.add_line = add_line
                _w(f"synclog {time.time():.3f} {h!r}")
    _main_native = threading.get_native_id()
    if os.environ.get("PROBE_SWITCH_S"):
        sys.setswitchinterval(float(os.environ["PROBE_SWITCH_S"]))
    _threads()
    os.register_at_fork(after_in_child=_threads)
    import uvloop
    _run = uvloop.run
    def run(coro, **kw):
        async def wrapped():
            import asyncio
            asyncio.get_running_loop().create_task(_lag())
            if os.environ.get("PROBE_SYNC_LOG") == "1":
                _sync_log()
            return await coro
        return _run(wrapped(), **kw)
    uvloop.run = run
