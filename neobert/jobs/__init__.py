"""Whole runs, one module per job: pretrain, glue, contrastive, mteb, throughput, pseudo_perplexity, ablations, export. Each `run_*` function is what its `experiments/` command line calls."""
