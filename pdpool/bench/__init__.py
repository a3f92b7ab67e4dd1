"""``pdpool bench``: measure any OpenAI-compatible endpoint (docs/bench.md).

``datasets`` builds the requests, ``client`` sends one streaming request and times it, ``load`` shapes the
arrivals (fixed concurrency, Poisson or gamma at a rate) under a request count and a time limit, ``stats`` turns
records into the summary (TTFT, TPOT, ITL, end-to-end latency, throughput, prefix-cache hits, goodput), ``report``
prints the table and reads/writes the JSON, ``vllm_result`` writes vLLM's result file (``--save-result``),
``plots`` draws the PNGs, ``flags`` parses the command line (with vLLM's spellings), ``main`` runs it.
No torch: token lengths come from ``pdpool.frontend`` when a tokenizer is available, else from words.
"""
