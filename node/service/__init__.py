"""The daemon's place in its host: the state directory and identity, systemd notifications,
and the lifeline that ends forked children with the daemon.
"""
