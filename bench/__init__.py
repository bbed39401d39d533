"""``make bench``: the demo model's throughput in-process, then through the whole fleet.

Both are measured in one run on one machine, so their ratio is the fleet's overhead
(queueing, HTTP, Redis, micro-batch assembly) rather than a difference between machines.
"""
