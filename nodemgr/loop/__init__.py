"""The event loop and what it owns: the server that binds the endpoints and runs every
turn, the connections and their caps, the wire transport, and the reclaims it carries out.
The composition root: it imports every other part of nodemgr; none imports it.
"""
