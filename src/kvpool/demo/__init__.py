"""The two demos of ``kvpool demo``: a node and a real vLLM engine on the tiny model, a
multi-turn chat with and without the pool (:mod:`.chat`), and the pool alone, no engine
(:mod:`.pool`).  What they run (a node child process, the tiny model, the engine runner,
the chat workload) is the harness the benchmarks and the tests share: :mod:`kvpool.harness`."""
