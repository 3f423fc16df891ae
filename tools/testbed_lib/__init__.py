"""Helpers of tools/testbed.py (the network-namespace testbed driver; run that, not these).

bed        the Bed (namespaces, node daemons, the coordinator), run/convert, constants
results    Result, a generate process's outcome and the parsing of the coordinator's stderr
delay      one-way latency per hop: tc netem, or a delay relay (testbed.py --delay-relay)
scenarios  the scenarios, in order
"""
