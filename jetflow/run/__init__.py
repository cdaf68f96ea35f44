"""A training run: build its pieces (build, sides), check them (validate), place them (local, Ray),
and run one sequence (sequence, loop) into one directory (files). `jetflow.run.runner.train` is the
entry point of `jetflow train`."""
