"""A stage server and everything it owns: the stage's module and optimizer, averaging with
the stage's other replicas, checkpoints, state transfer between replicas, its measured
throughput, and where in the pipeline a server sits (selection and placement).
"""
