"""The instruments: what measures or checks the suite's speed and memory, apart from the product it measures.

`experiments.throughput` (Figure 3, Table 9), `experiments.gpu_check`, `experiments.pretrain --preflight`,
`experiments.bench_data` and `scripts/bench/` run from here. This package sits above every other one: it may
import the jobs, the Lightning modules, the data and the model, and nothing that trains imports it
(tests/test_architecture.py). docs/architecture.md lists its modules.
"""
