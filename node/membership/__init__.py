"""Who is in the swarm: the DHT adapter, signed records, announcing our record and reading
the others', the peer table, and round-trip-time measurement.
"""
