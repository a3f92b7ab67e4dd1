"""``pdpool router``: the pool's OpenAI gateway with prefix- and load-aware prefill/decode routing.

See docs/router.md. Module map (one role each):

* ``main``: the command (flags from ``pdpool.config``, the YAML file), builds and runs everything;
* ``settings``: the YAML file merged under the flags, the scheduler's plugin list;
* ``endpoints``: ``Endpoint`` (a node as the router sees it) and the ``Pool`` snapshot discovery keeps;
* ``discovery_static``, ``discovery_redis``, ``discovery_k8s``: where nodes come from;
* ``prefix_index``: matched leading blocks per node, precise (Redis) or approximate (router-local LRU);
* ``inflight``: the router's own count of work sent to each node, updated at decision time;
* ``plugins``, ``filters``, ``scorers``, ``pickers``: the scheduling plugins; ``scheduler``: runs them and
  decides prefill/decode;
* ``request``: an OpenAI body validated and tokenized once (the shared front end);
* ``upstream``: HTTP legs to the nodes; ``handoff``: the request path (prefill, decode, retries, streaming,
  cancellation); ``app``: the HTTP surface; ``metrics``; ``openapi``; ``log``: the request id in every line.
"""
