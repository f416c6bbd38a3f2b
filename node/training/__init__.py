"""The trainer side: the model definition, the data a trainer reads, the router that picks one
server per stage, and the trainer that drives micro-batches through the pipeline.
"""
