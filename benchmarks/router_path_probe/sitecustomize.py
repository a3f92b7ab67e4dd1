"""A probe of the router's serial path per request, for the router overhead benchmark (not part of pdpool;
imported by Python at start-up from PYTHONPATH as ``sitecustomize``).

    PROBE_OUT=/tmp/path PYTHONPATH=$PWD/benchmarks/router_path_probe python3 benchmarks/router_overhead.py ...

In each process started as ``... router ...`` it stamps every generation request (``time.perf_counter_ns``):
``rx`` the first bytes read, ``done`` the request parsed whole, ``task`` its handler task running, ``sent`` the
upstream request written, ``up1`` the node's first bytes read, ``up`` the node's answer parsed whole, ``resp``
the answer written to the client, ``end`` the handler returned (bookkeeping included). At exit it writes
``$PROBE_OUT/<pid>.txt``: one line per request, the seven intervals in µs.
"""
import contextvars, os, sys, time

_out = os.environ.get("PROBE_OUT")
if _out and sys.argv[1:2] == ["router"]:
    import atexit, signal
    os.makedirs(_out, exist_ok=True)
    now = time.perf_counter_ns
    rows = []
    ctx = contextvars.ContextVar("probe", default=None)

    def _install():
        from pdpool.router import app, http1, server

        HC = server.HttpConnection
        orig_rx, orig_done = HC.data_received, HC.on_message_complete

        def data_received(self, data):
            if self.incoming is None:
                self._probe_rx = now()
            orig_rx(self, data)
        HC.data_received = data_received

        pending = {}

        def on_message_complete(self):   # the handler may run inside (eager start): note the times first
            r = self.incoming
            t = now()
            if r is not None:
                pending[id(r)] = (getattr(self, "_probe_rx", t), t)
            orig_done(self)
        HC.on_message_complete = on_message_complete

        orig_handle = app.Router.handle

        async def handle(self, request, exchange):
            rx, done = pending.pop(id(request), (0, 0))
            st = {"rx": rx, "done": done, "task": now()}
            ctx.set(st)
            await orig_handle(self, request, exchange)
            st["end"] = now()
            if request.method == "POST" and "resp" in st and "up" in st:
                rows.append(st)
                pre.append((st.get("json", 0) - st["task"], st.get("front", 0) - st.get("json", 0),
                            st.get("plan", 0) - st.get("front", 0), st["sent"] - st.get("plan", 0)))
        app.Router.handle = handle

        def stamp_after(obj, name, key, is_async=False):
            f = getattr(obj, name)
            if is_async:
                async def w(*a, **k):
                    r = await f(*a, **k)
                    st = ctx.get()
                    if st is not None:
                        st[key] = now()
                    return r
            else:
                def w(*a, **k):
                    r = f(*a, **k)
                    st = ctx.get()
                    if st is not None:
                        st[key] = now()
                    return r
            setattr(obj, name, w)

        from pdpool.router import scheduler, request as rq, prefix_index, handoff

        def timed(obj, name, is_async=False):
            f = getattr(obj, name)
            acc = durations.setdefault(f"{getattr(obj, '__name__', obj)}.{name}", [])
            if is_async:
                async def w(*a, **k):
                    t = now()
                    r = await f(*a, **k)
                    acc.append(now() - t)
                    return r
            else:
                def w(*a, **k):
                    t = now()
                    r = f(*a, **k)
                    acc.append(now() - t)
                    return r
            setattr(obj, name, w)

        from pdpool.router import index_mirror
        timed(index_mirror.IndexMirror, "lookup")
        timed(rq.RoutedRequest, "block_hashes")
        timed(rq.RoutedRequest, "upstream_bytes")
        timed(prefix_index.PrefixIndex, "lookup", True)
        timed(scheduler.Scheduler, "plan", True)
        timed(scheduler.Scheduler, "_rank")
        timed(scheduler.Scheduler, "fingerprint")
        timed(rq.protocol, "parse_completion")
        timed(app.Frontend, "encode_prompt_chunked")
        timed(http1.Http1Client, "request_now")
        timed(http1._Connection, "start")
        import resource
        f_start = http1._Connection.start
        sw = durations.setdefault("start_preempted", [])
        sw0 = durations.setdefault("start_not_preempted", [])

        def start2(*a, **k):
            c = resource.getrusage(resource.RUSAGE_THREAD).ru_nivcsw
            t = now()
            r = f_start(*a, **k)
            d = now() - t
            (sw if resource.getrusage(resource.RUSAGE_THREAD).ru_nivcsw != c else sw0).append(d)
            return r
        http1._Connection.start = start2
        timed(handoff.RequestPath, "_note")
        from pdpool.server import json_body
        stamp_after(json_body, "read_json_body", "json")
        stamp_after(app, "parse", "front")
        stamp_after(scheduler.Scheduler, "plan", "plan", True)

        C = http1._Connection
        orig_start, orig_crx, orig_cdone = C.start, C.data_received, C.on_message_complete

        def start(self, *a, **k):
            r = orig_start(self, *a, **k)
            st = ctx.get()
            if st is not None:
                st["sent"] = now()
                self._probe = st
            return r
        C.start = start

        def c_rx(self, data):
            st = getattr(self, "_probe", None)
            if st is not None and "up1" not in st:
                st["up1"] = now()
            orig_crx(self, data)
        C.data_received = c_rx

        relaying = []   # the request whose answer the node connection's callback is relaying (handoff._Relay)

        def c_done(self):
            st = getattr(self, "_probe", None)
            if st is not None:
                st["up"] = now()
                self._probe = None
                relaying.append(st)
            try:
                orig_cdone(self)
            finally:
                if st is not None:
                    relaying.pop()
        C.on_message_complete = c_done

        R = http1.Response
        orig_wait = R._wait_headers
        waits = durations.setdefault("sent_to_await", [])

        def _wait_headers(self):
            st = ctx.get()
            if st is not None and "sent" in st and "awaiting" not in st:
                st["awaiting"] = now()
                waits.append(st["awaiting"] - st["sent"])
            return orig_wait(self)
        R._wait_headers = _wait_headers

        E = server.Exchange
        orig_respond = E.respond

        def respond(self, *a, **k):
            orig_respond(self, *a, **k)
            st = relaying[-1] if relaying else ctx.get()
            if st is not None:
                st["resp"] = now()
        E.respond = respond

    pre = []
    durations = {}

    _prof = None
    if os.environ.get("PROBE_PROFILE"):
        import cProfile
        _prof = cProfile.Profile()

    def _dump(*_):
        if _prof is not None:
            _prof.disable()
            _prof.dump_stats(os.path.join(_out, f"{os.getpid()}.prof"))
        with open(os.path.join(_out, f"{os.getpid()}.dur"), "w") as f:
            for name, acc in durations.items():
                acc = sorted(acc)
                if acc:
                    f.write(f"{name:24s} n {len(acc):6d} p50 {acc[len(acc) // 2] / 1000:7.1f} "
                            f"p90 {acc[int(len(acc) * .9)] / 1000:7.1f} us\n")
        with open(os.path.join(_out, f"{os.getpid()}.pre"), "w") as f:
            f.write("json front plan send\n")
            for row in pre:
                f.write(" ".join(f"{x / 1000:.1f}" for x in row) + "\n")
        keys = ("rx", "done", "task", "sent", "up1", "up", "resp", "end")
        with open(os.path.join(_out, f"{os.getpid()}.txt"), "w") as f:
            f.write("parse task pre_send upstream1 upstream post end\n")
            for st in rows:
                if all(k in st for k in keys):
                    f.write(" ".join(f"{(st[b] - st[a]) / 1000:.1f}" for a, b in zip(keys, keys[1:])) + "\n")

    import builtins
    _orig_import = builtins.__import__
    _done = []

    def _hook(name, *a, **k):
        m = _orig_import(name, *a, **k)
        a = sys.modules.get("pdpool.router.app")
        if not _done and a is not None and hasattr(a, "Router"):
            _done.append(1)
            builtins.__import__ = _orig_import
            if _prof is not None:
                _prof.enable()
            else:
                _install()
        return m
    builtins.__import__ = _hook
    atexit.register(_dump)
