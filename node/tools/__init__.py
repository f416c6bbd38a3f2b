"""Programs beside the daemon: the local demo swarm and the single-process reference trainer.
Nothing in the daemon imports them.
"""
