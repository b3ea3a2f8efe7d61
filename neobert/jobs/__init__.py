"""Whole runs, one module per job (the list, with the command line of each: docs/architecture.md, "The jobs"); the
function a module's `experiments/` command line calls is the run."""
