"""What ``kvpool demo``, ``kvpool bench``, the benchmarks and the tests run, kept out of the
product packages: a node daemon as a child process (:mod:`.process`), a tiny model built
locally (:mod:`.tiny_model`), a vLLM engine driven through a plan of steps (:mod:`.runner`)
and the multi-turn chat workload (:mod:`.workload`)."""
